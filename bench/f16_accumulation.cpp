// Why f16 storage has no AVX512-FP16 kernel set: AVX512-FP16 multiplies and adds in f16 (vfmadd231ph) and has no
// f16 dot product that accumulates in f32. This program emulates Q·Kᵀ whose f16 partial sums are widened to f32
// every `chunk` products, runs the softmax and P·V in float64, rounds O to f16, and prints the error against float64
// beside the error of the plain implementation that accumulates Q·Kᵀ in f32 (the accuracy rule allows 2× it).
//   g++ -O2 -std=c++17 bench/f16_accumulation.cpp -o f16_accumulation && ./f16_accumulation
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

using f16 = _Float16;

namespace {

// O (rows × d) from the scores s(i, j), softmax and P·V in float64, optionally rounded to f16.
std::vector<double> finish(const std::vector<double>& s, const std::vector<f16>& v, int rows, int keys, int d,
                           double scale, bool round) {
  std::vector<double> o(static_cast<std::size_t>(rows) * d, 0.0);
  for (int i = 0; i < rows; ++i) {
    double m = -INFINITY, l = 0;
    for (int j = 0; j < keys; ++j) m = std::max(m, s[i * keys + j] * scale);
    for (int j = 0; j < keys; ++j) {
      const double p = std::exp(s[i * keys + j] * scale - m);
      l += p;
      for (int c = 0; c < d; ++c) o[i * d + c] += p * double(v[j * d + c]);
    }
    for (int c = 0; c < d; ++c) o[i * d + c] = round ? double(f16(o[i * d + c] / l)) : o[i * d + c] / l;
  }
  return o;
}

// Q·Kᵀ: chunk 0 = float64, chunk < 0 = f32 accumulation, chunk > 0 = f16 partial sums of `chunk` products.
std::vector<double> scores(const std::vector<f16>& q, const std::vector<f16>& k, int rows, int keys, int d,
                           int chunk) {
  std::vector<double> s(static_cast<std::size_t>(rows) * keys);
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < keys; ++j) {
      const f16* a = &q[i * d];
      const f16* b = &k[j * d];
      if (chunk == 0) {
        double acc = 0;
        for (int c = 0; c < d; ++c) acc += double(a[c]) * double(b[c]);
        s[i * keys + j] = acc;
      } else if (chunk < 0) {
        float acc = 0;
        for (int c = 0; c < d; ++c) acc = std::fma(float(a[c]), float(b[c]), acc);
        s[i * keys + j] = acc;
      } else {
        float acc = 0;
        for (int c0 = 0; c0 < d; c0 += chunk) {
          f16 part = 0;
          for (int c = c0; c < std::min(d, c0 + chunk); ++c)
            part = f16(std::fma(float(a[c]), float(b[c]), float(part)));
          acc += float(part);
        }
        s[i * keys + j] = acc;
      }
    }
  return s;
}

double max_error(const std::vector<double>& a, const std::vector<double>& b) {
  double e = 0;
  for (std::size_t i = 0; i < a.size(); ++i) e = std::max(e, std::abs(a[i] - b[i]));
  return e;
}

}  // namespace

int main() {
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  const int rows = 64, keys = 512;
  for (const int d : {64, 128}) {
    std::vector<f16> q(static_cast<std::size_t>(rows) * d), k(static_cast<std::size_t>(keys) * d), v(k.size());
    for (auto* t : {&q, &k, &v})
      for (auto& x : *t) x = f16(u(rng));
    const double scale = 1.0 / std::sqrt(double(d));
    const std::vector<double> exact = finish(scores(q, k, rows, keys, d, 0), v, rows, keys, d, scale, false);
    const double plain = max_error(finish(scores(q, k, rows, keys, d, -1), v, rows, keys, d, scale, true), exact);
    for (const int chunk : {4, 8, 32, d}) {
      const double err = max_error(finish(scores(q, k, rows, keys, d, chunk), v, rows, keys, d, scale, true), exact);
      std::printf("head_dim %3d, f16 partial sums of %3d products: O error %.3e, f32 accumulation %.3e (%.2fx)\n", d,
                  chunk, err, plain, err / plain);
    }
  }
}
