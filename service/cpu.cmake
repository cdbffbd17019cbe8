# fs_cpu_backend: the exact CPU sampler (OpenBLAS per vocabulary chunk, own
# thread pool) and its Engine wrapper; the reference for every GPU result.
add_library(fs_cpu_backend STATIC
  thread_pool.cc
  cpu_sampler.cc
  cpu_engine.cc)
target_include_directories(fs_cpu_backend PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(fs_cpu_backend
  PUBLIC fs_service_core PkgConfig::OPENBLAS Threads::Threads
         absl::synchronization absl::status absl::statusor absl::strings
         absl::str_format)
# cpu_engine.cc uses only the inline accessors of Weights; link the loader
# when it is part of the build so that users of CpuEngine::Create get it.
if(TARGET fs_weights)
  target_link_libraries(fs_cpu_backend PUBLIC fs_weights)
endif()
fs_target_warnings(fs_cpu_backend)
