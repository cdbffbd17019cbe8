# fs_weights: safetensors loader (single file, sharded index, directory) and
# deterministic synthetic weights. fs_status: absl::Status <-> gRPC status
# mapping and the fatal-device-error marker (the CUDA/NCCL half,
# cuda_status.cc, is compiled into fs_cuda_backend in CUDA builds only).
add_library(fs_weights STATIC
  weights.cc)
target_include_directories(fs_weights PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(fs_weights
  PUBLIC fs_service_core absl::status absl::statusor absl::strings
         absl::str_format
  PRIVATE nlohmann_json::nlohmann_json Threads::Threads)
fs_target_warnings(fs_weights)

add_library(fs_status STATIC
  status_util.cc)
target_include_directories(fs_status PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(fs_status
  PUBLIC absl::status absl::statusor absl::strings absl::cord gRPC::grpc++)
fs_target_warnings(fs_status)
