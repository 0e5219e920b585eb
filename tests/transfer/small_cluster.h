// A cluster small enough for a test, of Kimi-K2's kind: shared by the simulation's tests
// (tests/transfer/simulate_test.cc) and its report's (tests/apps/report_test.cc).
#pragma once

#include "weightlift/transfer/sim/cluster.h"

namespace wl::transfer::testing {

// A small model of Kimi-K2's kind: MLA, a dense first layer, a shared expert, routed experts.
inline K2Shapes small_k2() {
  return {.hidden = 512,
          .num_layers = 3,
          .first_dense = 1,
          .dense_ffn = 768,
          .num_experts = 16,
          .num_shared = 1,
          .moe_ffn = 256,
          .num_heads = 8,
          .q_lora = 192,
          .kv_lora = 64,
          .qk_nope = 32,
          .qk_rope = 16,
          .v_head = 32,
          .vocab = 1024};
}

// 16 trainers (HSDP dense meshes of 4, EP meshes of 2) to 8 receivers (2 engines of 4).
inline ClusterOptions small_cluster() {
  return {.k2 = small_k2(),
          .trainers = 16,
          .receivers = 8,
          .gpus_per_node = 4,
          .engine_gpus = 4,
          .dense_mesh = 4,
          .expert_mesh = 2};
}

}  // namespace wl::transfer::testing
