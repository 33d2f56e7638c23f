// The ops one source of vlserve's library calls from another (decoder_layer.cpp calls the products,
// norm, rotary and attention directly, without the dispatcher). Each is also registered as a torch
// op under the same name; their contracts are in vlserve.kernels.native.Kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <tuple>

namespace vlserve {

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& blocks);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       int64_t prefetch_rows);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& tiles, const c10::optional<at::Tensor>& bias,
                     int64_t outputs, c10::string_view isa_name);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                         const at::Tensor& sin);
at::Tensor one_query_attention(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                               const c10::optional<at::Tensor>& mask, double scale);
// Whether silu_mul gives at::silu(gate) * up's bits for that many elements on this CPU and thread count.
bool silu_mul_exact(int64_t elements);
at::Tensor silu_mul(const at::Tensor& gate_up);

}  // namespace vlserve
