/// @file my_attention.hpp
/// The function you write for the assignment "An optimized attention kernel is all you need", and the sizes the
/// harness (harness.cpp) calls it with. Nothing else of the assignment's code depends on fusedattn.
#pragma once

/// One attention call. Tensors are contiguous float32 arrays in [batch][heads][seq][dim] order:
/// Q and O hold batch·heads·seq_q·dim floats, K and V batch·heads·seq_kv·dim.
struct attention_problem {
  int batch;    ///< independent sequences
  int heads;    ///< attention heads (K and V have as many heads as Q)
  int seq_q;    ///< query rows per head (the harness also calls with seq_q != seq_kv)
  int seq_kv;   ///< key/value rows per head
  int dim;      ///< head dimension; the scale is 1/sqrt(dim)
  bool causal;  ///< query i sees keys 0..i only (top-left, as PyTorch's is_causal); rows past seq_kv see every key
  int threads;  ///< threads you may use (the harness times 1 and all of the machine's); ignoring it is allowed
};

/// O = softmax(Q·Kᵀ / sqrt(dim) + mask) · V for every (batch, head). Must write every element of O.
void my_attention(const float* q, const float* k, const float* v, float* o, const attention_problem& p);
