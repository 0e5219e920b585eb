# The layer rule of DESIGN.md ("a layer uses only layers listed below it"), checked when the
# build is configured: every weightlift library links only libraries earlier in WL_LAYERS.
# The order and each library's folder are also written to layers.json in the build tree, for
# tests/layering/check_sources.py, which checks the same rule for #includes and that no
# library source prints to stdout.
set(WL_LAYERS
  wl_core                 src/weightlift/core
  wl_kernels              src/weightlift/kernels
  wl_comm_topology        src/weightlift/comm/topology
  wl_comm_transport       src/weightlift/comm/transport
  wl_comm_store           src/weightlift/comm/store
  wl_comm_group           src/weightlift/comm/group
  wl_comm_collectives     src/weightlift/comm/collectives
  wl_comm_launch          src/weightlift/comm/launch
  wl_comm                 src/weightlift/comm
  wl_text                 src/weightlift/text
  wl_model                src/weightlift/model
  wl_train                src/weightlift/train
  wl_parallel_layout      src/weightlift/parallel/layout
  wl_parallel_model_parallel src/weightlift/parallel/model_parallel
  wl_parallel_data        src/weightlift/parallel/data
  wl_parallel_pipeline    src/weightlift/parallel/pipeline
  wl_parallel_run         src/weightlift/parallel/run
  wl_parallel             src/weightlift/parallel
  wl_transfer_layout      src/weightlift/transfer/layout
  wl_transfer_plan        src/weightlift/transfer/plan
  wl_transfer_sim         src/weightlift/transfer/sim
  wl_transfer_modes       src/weightlift/transfer/modes
  wl_transfer_fleet       src/weightlift/transfer/fleet
  wl_transfer             src/weightlift/transfer
  wl_infer                src/weightlift/infer
  wl_fault                src/weightlift/fault
  wl_rl                   src/weightlift/rl
)

function(wl_check_layers)
  set(below "")
  set(entries "")
  list(LENGTH WL_LAYERS n)
  math(EXPR last "${n} - 1")
  foreach(i RANGE 0 ${last} 2)
    math(EXPR j "${i} + 1")
    list(GET WL_LAYERS ${i} target)
    list(GET WL_LAYERS ${j} dir)
    get_target_property(direct ${target} LINK_LIBRARIES)
    get_target_property(iface ${target} INTERFACE_LINK_LIBRARIES)
    set(deps "")
    foreach(dep IN LISTS direct iface)
      if(dep MATCHES "^wl_" AND NOT dep MATCHES "^wl_(flags|dnnl)$")
        if(NOT dep IN_LIST below)
          message(FATAL_ERROR "layering: ${target} links ${dep}, which is not a layer below it "
                              "(cmake/layers.cmake lists the order)")
        endif()
        list(APPEND deps "\"${dep}\"")
      endif()
    endforeach()
    list(REMOVE_DUPLICATES deps)
    list(JOIN deps ", " deps_json)
    list(APPEND entries "  {\"target\": \"${target}\", \"dir\": \"${dir}\", \"deps\": [${deps_json}]}")
    list(APPEND below ${target})
  endforeach()
  list(JOIN entries ",\n" body)
  file(WRITE ${CMAKE_BINARY_DIR}/layers.json "[\n${body}\n]\n")
endfunction()
