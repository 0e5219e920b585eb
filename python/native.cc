// weightlift._native: the C++ side of the Python package (python/weightlift/__init__.py is the
// side users call). It takes tensors as (address, element count, dtype) triples that the Python
// side reads off torch tensors and numpy arrays, so nothing is copied on the way in, and hands
// receiver weights out as buffer objects that pin their version (torch.frombuffer on them gives
// a zero-copy tensor that keeps the pin alive).
//
// Every call that can block (connecting, collectives, updates, serving a round) releases the
// GIL. A non-OK Status becomes weightlift.Error carrying "Code: message".
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "weightlift/comm/collectives/allgather.h"
#include "weightlift/comm/collectives/allreduce.h"
#include "weightlift/comm/collectives/barrier.h"
#include "weightlift/comm/collectives/broadcast.h"
#include "weightlift/comm/group/group.h"
#include "weightlift/comm/launch/launch_env.h"
#include "weightlift/comm/launch/world.h"
#include "weightlift/core/dtype.h"
#include "weightlift/core/status.h"
#include "weightlift/model/config.h"
#include "weightlift/model/hf_checkpoint.h"
#include "weightlift/model/params.h"
#include "weightlift/transfer/fleet/fleet_receiver.h"
#include "weightlift/transfer/fleet/parameter_server.h"
#include "weightlift/transfer/layout/inference_layout.h"
#include "weightlift/transfer/layout/layout_spec.h"
#include "weightlift/transfer/modes/update_executor.h"

namespace py = pybind11;

namespace wl::python {
namespace {

// What weightlift.Error carries: the Status, spelled as everywhere else ("Code: message").
class StatusError : public std::runtime_error {
 public:
  explicit StatusError(const Status& s) : std::runtime_error(s.to_string()) {}
};

void check(const Status& s) {
  if (!s.ok()) throw StatusError(s);
}
template <class T>
T take(Result<T> r) {
  if (!r.ok()) throw StatusError(r.status());
  return std::move(r).value();
}

// A user's number as they would write it: "1e+308", "-1", "nan", never 309 digits.
std::string shown(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

std::chrono::milliseconds millis(double seconds, const char* what = "timeout") {
  if (!(seconds > 0) || seconds > 1e7) {
    throw StatusError(invalid_argument(std::string(what) + ": " + shown(seconds) +
                                       " s: expected seconds in (0, 1e7]"));
  }
  return std::chrono::milliseconds(int64_t(seconds * 1000));
}

// A count or index from Python, in [lo, hi], named in the error.
void check_in_range(const char* what, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) {
    throw StatusError(invalid_argument(std::string(what) + ": " + std::to_string(v) +
                                       ": expected an integer in [" + std::to_string(lo) + ", " +
                                       std::to_string(hi) + "]"));
  }
}

DType dtype_named(const std::string& name) {
  auto d = dtype_from_name(name);
  if (!d) throw StatusError(invalid_argument("unknown dtype '" + name + "'"));
  return *d;
}

// A tensor as the Python side describes it: where it is, how many elements, of what.
struct Buffer {
  uintptr_t address = 0;
  size_t count = 0;
  std::string dtype;  // safetensors spelling, "F32", "BF16", ...
  std::vector<int64_t> shape;
};

model::ModelConfig model_config(const std::string& model) {
  // A preset name, a Hugging Face checkpoint directory, or the path of a config.json.
  if (model.find('/') == std::string::npos && model.find(".json") == std::string::npos) {
    return take(model::preset(model));
  }
  if (std::filesystem::is_directory(model)) return take(model::open_hf_checkpoint(model)).config;
  return take(model::load_config(model));
}

// ---- the job: its store, rank 0 hosting it --------------------------------------------------

class Job {
 public:
  Job(const comm::LaunchEnv& env, std::chrono::milliseconds timeout)
      : world_(take(comm::connect_store(env, timeout))), timeout_(timeout) {
    // A first request now: the store drops a connection that has sent nothing within its
    // handshake timeout (10 s), and a Python program may well build its model before it
    // touches the job again.
    take(world_.store->add("py/connected", 1));
  }

  int rank() const { return world_.env.rank; }
  int size() const { return world_.env.world_size; }
  int local_rank() const { return world_.env.local_rank; }
  const std::string& launcher() const { return world_.env.launcher; }
  const std::shared_ptr<comm::Store>& store() const { return world_.store; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // Through the store, so that it needs no process group: rank 0 calls it last thing, since
  // its store leaves with it.
  // `count` ranks (0: every rank of the job) have arrived at `name`, or DeadlineExceeded.
  void wait_all(const std::string& name, std::chrono::milliseconds timeout, int count) {
    const std::string key = "py/wait/" + name;
    const int64_t arrived = take(world_.store->add(key, 1));
    if (arrived == (count > 0 ? count : world_.env.world_size)) {
      check(world_.store->set(key + "/done", comm::to_bytes("1")));
    }
    check(world_.store->get(key + "/done", timeout)
              .status()
              .with_context("waiting for every rank at '" + name + "' for " +
                            shown(double(timeout.count()) / 1000) + " s"));
  }

 private:
  comm::World world_;  // its store (rank 0 also its server); no group
  std::chrono::milliseconds timeout_{0};
};

// ---- a process group and its collectives ----------------------------------------------------

class ProcessGroup {
 public:
  ProcessGroup(const Job& job, std::chrono::milliseconds timeout, const std::string& name) {
    group_ = take(comm::Group::connect({.store = job.store(),
                                        .rank = job.rank(),
                                        .size = job.size(),
                                        .timeout = timeout,
                                        .prefix = "py/group/" + name}));
  }
  int rank() const { return group_->rank(); }
  int size() const { return group_->size(); }

  void allreduce(const Buffer& b, const std::string& op, double timeout_s) {
    const auto o = reduce_op(op);
    check(comm::allreduce(*group_, {.recv = reinterpret_cast<void*>(b.address),
                                    .count = b.count,
                                    .dtype = dtype_named(b.dtype),
                                    .op = o,
                                    .timeout = optional_timeout(timeout_s)}));
  }
  void broadcast(const Buffer& b, int root, double timeout_s) {
    check_root(root);
    check(comm::broadcast(*group_, {.buffer = reinterpret_cast<void*>(b.address),
                                    .count = b.count,
                                    .dtype = dtype_named(b.dtype),
                                    .root = root,
                                    .timeout = optional_timeout(timeout_s)}));
  }
  void allgather(const Buffer& in, const Buffer& out, double timeout_s) {
    if (in.dtype != out.dtype) {
      throw StatusError(invalid_argument("allgather: input is " + in.dtype + ", output " +
                                         out.dtype + "; they must match"));
    }
    if (out.count != in.count * size_t(size())) {
      throw StatusError(invalid_argument("allgather: output holds " + std::to_string(out.count) +
                                         " elements; " + std::to_string(size()) + " ranks of " +
                                         std::to_string(in.count) + " need " +
                                         std::to_string(in.count * size_t(size()))));
    }
    check(comm::allgather(*group_, {.send = reinterpret_cast<const void*>(in.address),
                                    .recv = reinterpret_cast<void*>(out.address),
                                    .count = in.count,
                                    .dtype = dtype_named(in.dtype),
                                    .timeout = optional_timeout(timeout_s)}));
  }
  void barrier(double timeout_s) {
    check(comm::barrier(*group_, {.timeout = optional_timeout(timeout_s)}));
  }

 private:
  static comm::ReduceOp reduce_op(const std::string& op) {
    if (op == "sum") return comm::ReduceOp::kSum;
    if (op == "prod") return comm::ReduceOp::kProd;
    if (op == "max") return comm::ReduceOp::kMax;
    if (op == "min") return comm::ReduceOp::kMin;
    if (op == "avg") return comm::ReduceOp::kAvg;
    throw StatusError(
        invalid_argument("reduce op '" + op + "': expected sum, prod, max, min or avg"));
  }
  static std::chrono::milliseconds optional_timeout(double seconds) {
    return seconds == 0 ? std::chrono::milliseconds(0) : millis(seconds);
  }
  void check_root(int root) const {
    if (root < 0 || root >= size()) {
      throw StatusError(invalid_argument("root " + std::to_string(root) + " of a group of " +
                                         std::to_string(size()) + " ranks"));
    }
  }
  std::shared_ptr<comm::Group> group_;
};

// ---- the parameter server ---------------------------------------------------------------------

// Named tensors as the server takes them, borrowed: the shards are copied from them directly
// (no f32 copy of the model on the way). The server checks that they are every parameter of
// the model with its shape; a dtype other than f32 or bf16 is refused here, by name.
std::vector<transfer::NamedTensor> named_views(const std::map<std::string, Buffer>& tensors) {
  std::vector<transfer::NamedTensor> out;
  out.reserve(tensors.size());
  for (const auto& [name, b] : tensors) {
    if (b.dtype != "F32" && b.dtype != "BF16") {
      throw StatusError(
          invalid_argument("tensor '" + name + "' is " + b.dtype + "; parameters are F32 or BF16"));
    }
    out.push_back({.name = name,
                   .dtype = b.dtype == "F32" ? DType::kF32 : DType::kBF16,
                   .shape = b.shape,
                   .data = reinterpret_cast<const void*>(b.address)});
  }
  return out;
}

py::dict update_dict(const transfer::ServerUpdate& u) {
  py::dict d;
  d["version"] = u.report.version;
  d["round"] = u.round;
  d["replay"] = u.replay;
  d["generation"] = u.generation;
  std::vector<int> members;
  for (const auto& m : u.members) members.push_back(m.id);
  d["receivers"] = members;
  d["dropped"] = u.dropped;
  d["bytes"] = u.report.bytes;
  d["seconds"] = u.report.total_seconds;
  return d;
}

class Server {
 public:
  Server(const Job& job, int rank, int size, const std::string& mode, const std::string& prefix,
         double timeout_s, const std::string& shard_dtype) {
    check_in_range("size", size, 1, 1 << 20);
    check_in_range("rank", rank, 0, size - 1);
    auto m = transfer::transfer_mode_from_name(mode);
    if (!m || *m == transfer::TransferMode::kNaive) {
      throw StatusError(invalid_argument("mode '" + mode + "': expected p2p or broadcast"));
    }
    if (shard_dtype != "F32" && shard_dtype != "BF16") {
      throw StatusError(
          invalid_argument("shard dtype '" + shard_dtype + "': expected F32 or BF16"));
    }
    transfer::ParameterServerOptions o{.store = job.store(),
                                       .rank = rank,
                                       .size = size,
                                       .prefix = prefix,
                                       .timeout = millis(timeout_s),
                                       .mode = *m,
                                       .shard_dtype = dtype_named(shard_dtype)};
    py::gil_scoped_release unlocked;
    server_ = take(transfer::ParameterServer::create(o));
  }

  void register_files(const std::string& name, const std::string& model,
                      const std::vector<std::string>& files) {
    const model::ModelConfig config = model_config(model);
    py::gil_scoped_release unlocked;
    check(server_->register_checkpoint(name, config, files));
  }
  // A Hugging Face checkpoint directory: its config and its weights, whatever family.
  void register_model_dir(const std::string& name, const std::string& dir) {
    py::gil_scoped_release unlocked;
    const model::HfCheckpoint hf = take(model::open_hf_checkpoint(dir));
    std::vector<float> full(size_t(model::ParamLayout(hf.config).total()));
    check(model::read_hf_params(hf, full.data()));
    check(server_->register_checkpoint(name, hf.config, full));
  }
  void register_tensors(const std::string& name, const std::string& model,
                        const std::map<std::string, Buffer>& tensors) {
    const model::ModelConfig config = model_config(model);
    // The GIL stays held: the server reads the caller's tensors, which another thread could
    // free (the call blocks on nothing but the copy).
    check(server_->register_checkpoint(name, config, named_views(tensors)));
  }
  // Another model's state dict, by its layout spec (JSON).
  void register_layout_tensors(const std::string& name, const std::string& layout_json,
                               const std::map<std::string, Buffer>& tensors) {
    const transfer::LayoutSpec spec =
        take(transfer::layout_spec_from_json(layout_json, "register_checkpoint's layout"));
    check(server_->register_checkpoint(name, spec, named_views(tensors)));  // the GIL held
  }
  void register_layout_files(const std::string& name, const std::string& layout_json,
                             const std::vector<std::string>& files) {
    const transfer::LayoutSpec spec =
        take(transfer::layout_spec_from_json(layout_json, "register_checkpoint's layout"));
    py::gil_scoped_release unlocked;
    check(server_->register_checkpoint(name, spec, files));
  }
  void refresh(const std::string& name, const std::map<std::string, Buffer>& tensors) {
    check(server_->refresh(name, named_views(tensors)));  // the GIL held, as registering
  }
  void unregister(const std::string& name) { check(server_->unregister_checkpoint(name)); }
  std::vector<std::string> checkpoints() const { return server_->checkpoints(); }

  py::dict update(const std::string& name, const std::vector<int>& receivers) {
    transfer::ServerUpdate u;
    {
      py::gil_scoped_release unlocked;
      u = take(server_->update(name, receivers));
    }
    return update_dict(u);
  }
  // Polls the fleet until `count` receivers have joined; their ids.
  std::vector<int> wait_for_receivers(int count, double timeout_s) {
    py::gil_scoped_release unlocked;
    const auto end = std::chrono::steady_clock::now() + millis(timeout_s);
    for (;;) {
      std::vector<int> ids = take(server_->joined_receivers());
      if (int(ids.size()) >= count) return ids;
      if (std::chrono::steady_clock::now() >= end) {
        throw StatusError(deadline_exceeded(std::to_string(ids.size()) + " of " +
                                            std::to_string(count) + " receivers joined within " +
                                            std::to_string(timeout_s) + " s"));
      }
      // Joining is a store record; a receiver starting up takes a fraction of a second.
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  void serve_for(double seconds) {
    const auto span = millis(seconds, "serve_for");
    py::gil_scoped_release unlocked;
    server_->serve_for(span);
  }

 private:
  std::unique_ptr<transfer::ParameterServer> server_;
};

// ---- receivers --------------------------------------------------------------------------------

// One version of a receiver's weights, pinned: the update never writes the slot under it.
struct Pin {
  std::shared_ptr<transfer::FleetReceiver> owner;  // outlives the guard
  transfer::Receiver::ReadGuard guard;
};

// The bytes of one tensor of a pinned version, as a buffer object.
struct View {
  std::shared_ptr<Pin> pin;
  std::byte* data = nullptr;
  size_t bytes = 0;
};

class Weights {
 public:
  explicit Weights(std::shared_ptr<Pin> pin) : pin_(std::move(pin)) {}
  uint64_t version() const { return pinned().guard.version(); }
  View view(const std::string& name) const {
    const Pin& pin = pinned();
    const transfer::ReceiverEntry* e = pin.owner->receiver().find(name);
    if (!e) throw StatusError(not_found("the receiver holds no tensor '" + name + "'"));
    Tensor t = pin.guard.tensor(name);
    return View{pin_, static_cast<std::byte*>(t.raw()), e->bytes};
  }
  void release() { pin_.reset(); }

 private:
  // The pin, or an error once release() dropped it: the version may be overwritten by then.
  const Pin& pinned() const {
    if (!pin_) {
      throw StatusError(failed_precondition(
          "these weights were released: acquire() the receiver's weights again to read them"));
    }
    return *pin_;
  }

  std::shared_ptr<Pin> pin_;
};

class FleetReceiver {
 public:
  // What it holds: our model's inference layout (`model`: a preset or config.json), or what
  // a layout spec (`layout_json`) makes of another model's weights; exactly one is given.
  FleetReceiver(const Job& job, int id, const std::string& model, const std::string& layout_json,
                const std::string& format, const std::string& prefix, double timeout_s, bool heal) {
    check_in_range("id", id, 0, (1 << 20) - 1);
    auto f = transfer::weight_format_from_name(format);
    if (!f) throw StatusError(invalid_argument("format '" + format + "': expected bf16 or fp8"));
    if (model.empty() == layout_json.empty()) {
      throw StatusError(invalid_argument("a receiver holds a model or a layout, exactly one"));
    }
    const auto layout =
        model.empty()
            ? take(transfer::spec_layout(
                  transfer::spec_in_format(
                      take(transfer::layout_spec_from_json(layout_json, "the receiver's layout")),
                      *f),
                  1, 0))
            : take(transfer::inference_layout(model_config(model), {.format = *f}));
    transfer::FleetReceiverOptions o{
        .store = job.store(),
        .prefix = prefix,
        .id = id,
        .receiver = {.tensors = transfer::tensor_specs(layout), .format = *f},
        .timeout = millis(timeout_s),
        .heal = heal};
    py::gil_scoped_release unlocked;
    fleet_ = std::shared_ptr<transfer::FleetReceiver>(take(transfer::FleetReceiver::create(o)));
  }

  // {"round", "replay", "kind", "took_part", "left_behind", "version"}, or raises
  // (DeadlineExceeded if none came).
  py::dict serve_one(double timeout_s) {
    transfer::RoundOutcome r;
    {
      py::gil_scoped_release unlocked;
      r = take(fleet_->serve_one(millis(timeout_s)));
    }
    py::dict d;
    d["round"] = r.round;
    d["replay"] = r.replay;
    d["kind"] = r.kind == transfer::RoundRecord::Kind::kForm     ? "form"
                : r.kind == transfer::RoundRecord::Kind::kRefuse ? "refuse"
                                                                 : "update";
    d["took_part"] = r.took_part;
    d["left_behind"] = r.left_behind;
    d["version"] = r.version;
    return d;
  }
  uint64_t version() const { return fleet_->receiver().version(); }
  uint64_t healed_version() const { return fleet_->healed_version(); }
  void leave() {
    py::gil_scoped_release unlocked;
    check(fleet_->leave());
  }
  // (name, dtype, shape) of every tensor held, in slot order.
  std::vector<std::tuple<std::string, std::string, std::vector<int64_t>>> tensors() const {
    std::vector<std::tuple<std::string, std::string, std::vector<int64_t>>> out;
    for (const auto& e : fleet_->receiver().entries()) {
      out.emplace_back(e.spec.name, std::string(dtype_name(e.spec.dtype)), e.spec.shape);
    }
    return out;
  }
  // Where both slots live: [begin, end) of the addresses a received tensor can have.
  std::pair<uintptr_t, uintptr_t> memory_range() const {
    const transfer::Receiver& r = fleet_->receiver();
    const auto s0 = r.slot(0), s1 = r.slot(1);
    const auto begin = reinterpret_cast<uintptr_t>(std::min(s0.data(), s1.data()));
    const auto end =
        reinterpret_cast<uintptr_t>(std::max(s0.data() + s0.size(), s1.data() + s1.size()));
    return {begin, end};
  }
  Weights acquire() {
    auto pin = std::make_shared<Pin>(Pin{fleet_, fleet_->receiver().acquire()});
    return Weights(std::move(pin));
  }

 private:
  std::shared_ptr<transfer::FleetReceiver> fleet_;
};

// Jobs, buffers and the process group's collectives.
void bind_jobs(py::module_& m) {
  py::class_<Buffer>(m, "Buffer")
      .def(py::init<uintptr_t, size_t, std::string, std::vector<int64_t>>(), py::arg("address"),
           py::arg("count"), py::arg("dtype"), py::arg("shape"));

  py::class_<Job>(m, "Job")
      .def(py::init([](double timeout_s) {
             auto env = take(wl::comm::read_launch_env());
             const auto timeout = millis(timeout_s);
             py::gil_scoped_release unlocked;
             return std::make_unique<Job>(env, timeout);
           }),
           py::arg("timeout"))
      .def_property_readonly("rank", &Job::rank)
      .def_property_readonly("size", &Job::size)
      .def_property_readonly("local_rank", &Job::local_rank)
      .def_property_readonly("launcher", &Job::launcher)
      .def(
          "wait_all",
          [](Job& j, const std::string& name, double timeout_s, int count) {
            check_in_range("ranks", count, 0, j.size());
            const auto timeout = millis(timeout_s);
            py::gil_scoped_release unlocked;
            j.wait_all(name, timeout, count);
          },
          py::arg("name"), py::arg("timeout"), py::arg("count") = 0);

  py::class_<ProcessGroup>(m, "ProcessGroup")
      .def(py::init([](const Job& job, double timeout_s, const std::string& name) {
             const auto timeout = millis(timeout_s);
             py::gil_scoped_release unlocked;
             return std::make_unique<ProcessGroup>(job, timeout, name);
           }),
           py::arg("job"), py::arg("timeout"), py::arg("name"))
      .def_property_readonly("rank", &ProcessGroup::rank)
      .def_property_readonly("size", &ProcessGroup::size)
      .def("allreduce", &ProcessGroup::allreduce, py::arg("buffer"), py::arg("op"),
           py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def("broadcast", &ProcessGroup::broadcast, py::arg("buffer"), py::arg("root"),
           py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def("allgather", &ProcessGroup::allgather, py::arg("input"), py::arg("output"),
           py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def("barrier", &ProcessGroup::barrier, py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>());
}

// The parameter server, and receivers with the weights they hold.
void bind_transfer(py::module_& m) {
  py::class_<Server>(m, "ParameterServer")
      .def(py::init<const Job&, int, int, const std::string&, const std::string&, double,
                    const std::string&>(),
           py::arg("job"), py::arg("rank"), py::arg("size"), py::arg("mode"), py::arg("prefix"),
           py::arg("timeout"), py::arg("shard_dtype"))
      .def("register_model_dir", &Server::register_model_dir, py::arg("name"), py::arg("dir"))
      .def("register_files", &Server::register_files, py::arg("name"), py::arg("model"),
           py::arg("files"))
      .def("register_tensors", &Server::register_tensors, py::arg("name"), py::arg("model"),
           py::arg("tensors"))
      .def("register_layout_tensors", &Server::register_layout_tensors, py::arg("name"),
           py::arg("layout"), py::arg("tensors"))
      .def("register_layout_files", &Server::register_layout_files, py::arg("name"),
           py::arg("layout"), py::arg("files"))
      .def("refresh", &Server::refresh, py::arg("name"), py::arg("tensors"))
      .def("unregister", &Server::unregister, py::arg("name"))
      .def("checkpoints", &Server::checkpoints)
      .def("update", &Server::update, py::arg("name"), py::arg("receivers"))
      .def("wait_for_receivers", &Server::wait_for_receivers, py::arg("count"), py::arg("timeout"))
      .def("serve_for", &Server::serve_for, py::arg("seconds"));

  py::class_<View>(m, "View", py::buffer_protocol()).def_buffer([](View& v) {
    return py::buffer_info(v.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                           {py::ssize_t(v.bytes)}, {py::ssize_t(1)});
  });

  py::class_<Weights>(m, "Weights")
      .def_property_readonly("version", &Weights::version)
      .def("view", &Weights::view, py::arg("name"))
      .def("release", &Weights::release);

  py::class_<FleetReceiver>(m, "Receiver")
      .def(py::init<const Job&, int, const std::string&, const std::string&, const std::string&,
                    const std::string&, double, bool>(),
           py::arg("job"), py::arg("id"), py::arg("model"), py::arg("layout"), py::arg("format"),
           py::arg("prefix"), py::arg("timeout"), py::arg("heal"))
      .def("serve_one", &FleetReceiver::serve_one, py::arg("timeout"))
      .def_property_readonly("version", &FleetReceiver::version)
      .def_property_readonly("healed_version", &FleetReceiver::healed_version)
      .def("leave", &FleetReceiver::leave)
      .def("tensors", &FleetReceiver::tensors)
      .def("memory_range", &FleetReceiver::memory_range)
      .def("acquire", &FleetReceiver::acquire);
}

}  // namespace
}  // namespace wl::python

PYBIND11_MODULE(_native, m) {
  using namespace wl::python;
  m.doc() = "weightlift's C++ side; use the weightlift package, not this module";
  py::register_exception<StatusError>(m, "Error", PyExc_RuntimeError);

  m.def(
      "parameters",
      [](const std::string& model) {
        std::vector<std::pair<std::string, std::vector<int64_t>>> out;
        const wl::model::ParamLayout layout(model_config(model));
        for (const wl::model::ParamInfo& p : layout.params()) out.emplace_back(p.name, p.shape);
        return out;
      },
      py::arg("model"));

  // The receiver tensors of a layout spec (transfer/layout/layout_spec.h) at one TP rank:
  // (name, dtype, shape, [(source, row_begin, row_end, col_begin, col_end, dst_row)]).
  m.def(
      "spec_layout",
      [](const std::string& json_text, int tp, int tp_rank) {
        const wl::transfer::LayoutSpec spec =
            take(wl::transfer::layout_spec_from_json(json_text, "layout spec"));
        using Slice = std::tuple<std::string, int64_t, int64_t, int64_t, int64_t, int64_t>;
        std::vector<std::tuple<std::string, std::string, std::vector<int64_t>, std::vector<Slice>>>
            out;
        for (const wl::transfer::ReceiverTensor& t :
             take(wl::transfer::spec_layout(spec, tp, tp_rank))) {
          std::vector<Slice> slices;
          for (const wl::transfer::SourceSlice& s : t.sources) {
            slices.emplace_back(s.param, s.row_begin, s.row_end, s.col_begin, s.col_end, s.dst_row);
          }
          out.emplace_back(t.name, std::string(wl::dtype_name(t.dtype)), t.shape,
                           std::move(slices));
        }
        return out;
      },
      py::arg("spec"), py::arg("tp"), py::arg("tp_rank"));

  bind_jobs(m);
  bind_transfer(m);
}
