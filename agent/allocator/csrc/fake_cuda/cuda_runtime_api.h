// TEST DOUBLE. The few declarations of the CUDA runtime API that cuda_backend.cpp uses, with the
// real signatures, for building the backend against the fake runtime (fake_cudart.cpp). It exists
// only because no GPU (and no CUDA toolkit) is available where memplan's tests run; a real build
// uses the CUDA runtime's own header (scripts/check_cuda_build.sh compiles against it).
#pragma once

#include <cstddef>

extern "C" {

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidResourceHandle = 400,
} cudaError_t;

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;

#define cudaEventDisableTiming 0x02

cudaError_t cudaMalloc(void** devPtr, size_t size);
cudaError_t cudaFree(void* devPtr);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetLastError(void);
const char* cudaGetErrorString(cudaError_t error);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
}
