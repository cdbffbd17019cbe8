# Shared build helpers: warning flags per target and one way to add a test.

# Applies the project's warning flags to a target.
function(fs_target_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra>
    $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${FS_WERROR}>>:-Werror>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
endfunction()

# fs_add_test(NAME name SOURCES a.cc ... LIBS lib ... [LABELS l ...] [TIMEOUT s])
# Builds a GoogleTest binary and registers each of its tests with CTest.
function(fs_add_test)
  cmake_parse_arguments(T "" "NAME;TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  add_executable(${T_NAME} ${T_SOURCES})
  target_link_libraries(${T_NAME} PRIVATE ${T_LIBS} GTest::gtest GTest::gmock GTest::gtest_main)
  target_include_directories(${T_NAME} PRIVATE ${PROJECT_SOURCE_DIR})
  fs_target_warnings(${T_NAME})
  gtest_discover_tests(${T_NAME}
    DISCOVERY_TIMEOUT 60
    PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "${T_LABELS}"
               # A GTEST_SKIP (GPU tests without a GPU) shows as "Skipped" in CTest.
               SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]"
               ENVIRONMENT "NCCL_NVLS_ENABLE=0;NVSHMEM_DISABLE_NVLS=1;TORCH_SYMM_MEM_DISABLE_MULTICAST=1")
endfunction()
