# Read by CTest after the tests that gtest_discover_tests found (tests/CMakeLists.txt,
# TEST_INCLUDE_FILES): test_cuda_engine's two NCCL processes on two GPUs run alone,
# like the other multi-process NCCL tests. A name CTest does not know is ignored.
set_tests_properties(CudaEngine.NcclProcessesTrainLikeTheSameWorldOnTheCpu_OnTwoGpus PROPERTIES RUN_SERIAL ON)
