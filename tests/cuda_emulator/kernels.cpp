// npformer's CUDA kernels compiled for the host with the emulator (emulator.h), exported for
// ctypes: <kernel>_<type>[_<template argument>](grid, block, args, seed, types, expected) launches
// the instance with `args` as CUDA takes kernel parameters (an array of pointers to the values)
// after checking their types (see emulator::launch).
#include "emulator.h"

#include "dropout.cu"
#include "flash_attention.cu"

#define EXPORT(symbol, ...) \
    extern "C" int symbol(unsigned int grid, unsigned int block, void** args, unsigned long long seed, \
                          const char* types, char* expected) { \
        return emulator::launch(__VA_ARGS__, grid, block, args, seed, types, expected); \
    }

EXPORT(dropout_apply_float, dropout_apply<float>)
EXPORT(dropout_apply_double, dropout_apply<double>)

#define EXPORT_FLASH(T, D) \
    EXPORT(flash_attention_forward_##T##_##D, flash_attention_forward<T, D>) \
    EXPORT(flash_attention_backward_dq_##T##_##D, flash_attention_backward_dq<T, D>) \
    EXPORT(flash_attention_backward_dkdv_##T##_##D, flash_attention_backward_dkdv<T, D>)

EXPORT_FLASH(float, 32)
EXPORT_FLASH(float, 64)
EXPORT_FLASH(float, 128)
EXPORT_FLASH(double, 32)
EXPORT_FLASH(double, 64)
EXPORT_FLASH(double, 128)
