// src/device/cpu/simd.h - FSDP_SIMD_CLONES: compile a hot loop twice, for x86
// with AVX2 and for the baseline, and pick at load time, so one binary is fast
// on new machines and still runs on old ones. Contraction into FMA stays off
// (ISO mode), so both clones compute the same bits.
#pragma once

//
// Not under sanitizers: the ifunc resolver runs during relocation, before the
// sanitizer runtime is up, and instrumented resolver code crashes there.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_THREAD__) && \
    !defined(__SANITIZE_ADDRESS__)
#define FSDP_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define FSDP_SIMD_CLONES
#endif
