// One decoder layer of Qwen3-VL's text model for a decode step, in one call from Python.
//
// A decode step's products stream the weights at the memory's speed; around them each layer ran
// about 25 small operations from Python (norms, views, splits, the cache's writes, residual adds,
// SiLU), 5-7 us each on a 2-vCPU VM: about 6 ms of a 32 ms int4 step, a fifth of it. Here the layer
// runs the same operations from C++, in the same order and with the same roundings, so its output
// is the Python layer's bit for bit (tests/test_decoder_layer.py): vlserve's products, norm, rotary
// and attention called directly (ops.h), the rest as the ATen functions torch's Python calls.
//
// `Product` is one linear layer's (or one fused group's) weight in the form the Python format holds
// it (vlserve.model.decoderops says which formats it takes): plain bfloat16 parts (the exact level,
// packing.NativeBf16Weight), Q8_0 tiles (quantized.Int8Weight) or int4 blocks (quantized.Int4Weight),
// with the outlier channels a rounded weight keeps exact (quantized.ExactChannels). `DecoderLayer`
// holds a layer's four products and norms and runs `decode`: hidden (batch, 1, hidden) bfloat16 and
// the step's rotary tables in, the layer's output out; its new key and value are written into the
// cache's buffers at `start` (vlserve.runtime.kvcache.GrowingLayer.reserve) and it attends over the
// first start + 1 tokens.
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/silu.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

#include "ops.h"

namespace {

enum Kind : int64_t { kBf16 = 0, kQ8 = 1, kInt4 = 2 };  // as vlserve.model.decoderops names them

struct Product : torch::CustomClassHolder {
  int64_t kind, outputs;
  std::vector<at::Tensor> weights;  // bfloat16 parts (one per fused member), or the tiles, or the blocks
  c10::optional<at::Tensor> bias;
  // ExactChannels: input columns multiplied apart in float32, output rows from exact weights.
  c10::optional<at::Tensor> columns, column_weights, rows, row_weights, row_bias;

  Product(int64_t kind, std::vector<at::Tensor> weights, c10::optional<at::Tensor> bias, int64_t outputs,
          c10::optional<at::Tensor> columns, c10::optional<at::Tensor> column_weights, c10::optional<at::Tensor> rows,
          c10::optional<at::Tensor> row_weights, c10::optional<at::Tensor> row_bias)
      : kind(kind),
        outputs(outputs),
        weights(std::move(weights)),
        bias(std::move(bias)),
        columns(std::move(columns)),
        column_weights(std::move(column_weights)),
        rows(std::move(rows)),
        row_weights(std::move(row_weights)),
        row_bias(std::move(row_bias)) {
    TORCH_CHECK(kind == kBf16 || kind == kQ8 || kind == kInt4, "Product: unknown kind ", kind);
    TORCH_CHECK(!this->weights.empty() && (kind == kBf16 || this->weights.size() == 1),
                "Product: bfloat16 takes its parts, int8 and int4 one tensor");
    TORCH_CHECK(this->columns.has_value() == this->column_weights.has_value(), "Product: columns need their weights");
    TORCH_CHECK(this->rows.has_value() == this->row_weights.has_value(), "Product: rows need their weights");
  }

  // The rounded or plain weight's product, as the format's matmul computes it.
  at::Tensor inner(const at::Tensor& x, int64_t prefetch_rows, const std::string& isa) const {
    if (kind == kBf16) {  // NativeBf16Weight: each part, then their concatenation, then the bias
      std::vector<at::Tensor> outs;
      outs.reserve(weights.size());
      for (const at::Tensor& part : weights) outs.push_back(vlserve::bf16_linear(x, part, c10::nullopt, prefetch_rows));
      at::Tensor out = outs.size() == 1 ? outs[0] : at::cat(outs, -1);
      return bias.has_value() ? out.add_(*bias) : out;
    }
    if (kind == kQ8)  // Int8Weight: bfloat16 rows as they are, other dtypes in float32
      return vlserve::q8_linear(x.scalar_type() == at::kBFloat16 ? x : x.to(at::kFloat), weights[0], bias, outputs, isa);
    if (!bias.has_value()) return vlserve::int4_linear(x, weights[0]);  // Int4Weight
    return vlserve::int4_linear(x.to(at::kFloat), weights[0]).to(at::kFloat).add_(*bias);
  }

  // ExactChannels.matmul around the inner product.
  at::Tensor apply(const at::Tensor& x, int64_t prefetch_rows, const std::string& isa) const {
    at::Tensor out;
    if (!columns.has_value()) {
      out = inner(x, prefetch_rows, isa);
    } else {
      const at::Tensor apart = at::matmul(x.index_select(1, *columns).to(at::kFloat), column_weights->t());
      out = inner(x.index_fill(1, *columns, 0), prefetch_rows, isa).to(at::kFloat).add_(apart);
    }
    if (rows.has_value()) {
      const at::Tensor wide = x.to(at::kFloat);
      const at::Tensor exact = row_bias.has_value() ? at::addmm(*row_bias, wide, row_weights->t())
                                                    : at::matmul(wide, row_weights->t());
      out = out.to(at::kFloat).index_copy_(1, *rows, exact);
    }
    return out;
  }
};

struct DecoderLayer : torch::CustomClassHolder {
  at::Tensor input_norm, post_norm, q_norm, k_norm;
  double eps;
  c10::intrusive_ptr<Product> qkv, o, gate_up, down;
  int64_t heads, kv_heads, head_dim, intermediate;
  double scale;
  int64_t prefetch_rows;
  std::string isa;

  DecoderLayer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor q_norm, at::Tensor k_norm, double eps,
               c10::intrusive_ptr<Product> qkv, c10::intrusive_ptr<Product> o, c10::intrusive_ptr<Product> gate_up,
               c10::intrusive_ptr<Product> down, int64_t heads, int64_t kv_heads, int64_t head_dim,
               int64_t intermediate, double scale, int64_t prefetch_rows, std::string isa)
      : input_norm(std::move(input_norm)),
        post_norm(std::move(post_norm)),
        q_norm(std::move(q_norm)),
        k_norm(std::move(k_norm)),
        eps(eps),
        qkv(std::move(qkv)),
        o(std::move(o)),
        gate_up(std::move(gate_up)),
        down(std::move(down)),
        heads(heads),
        kv_heads(kv_heads),
        head_dim(head_dim),
        intermediate(intermediate),
        scale(scale),
        prefetch_rows(prefetch_rows),
        isa(std::move(isa)) {
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 16 == 0, "DecoderLayer: heads must share key heads evenly, "
                "and the head dimension be a multiple of 16");
    TORCH_CHECK(this->qkv->outputs == (heads + 2 * kv_heads) * head_dim && this->gate_up->outputs == 2 * intermediate,
                "DecoderLayer: the fused products' outputs do not match the heads and the MLP's width");
  }

  // PackedLinear.forward on (rows, in): the product, in the hidden states' dtype.
  at::Tensor project(const Product& product, const at::Tensor& rows, at::ScalarType dtype) const {
    at::Tensor out = product.apply(rows, prefetch_rows, isa);
    return out.scalar_type() == dtype ? out : out.to(dtype);
  }

  at::Tensor decode(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& key_buffer,
                    const at::Tensor& value_buffer, int64_t start, const c10::optional<at::Tensor>& mask) const {
    TORCH_CHECK(hidden.dim() == 3 && hidden.size(1) == 1 && hidden.scalar_type() == at::kBFloat16,
                "DecoderLayer.decode: hidden states must be (batch, 1, hidden) bfloat16");
    const int64_t batch = hidden.size(0), width = hidden.size(2), q_width = heads * head_dim,
                  kv_width = kv_heads * head_dim;
    const at::ScalarType dtype = hidden.scalar_type();
    TORCH_CHECK(key_buffer.dim() == 4 && key_buffer.size(0) == batch && key_buffer.size(1) == kv_heads &&
                    key_buffer.size(3) == head_dim && value_buffer.sizes() == key_buffer.sizes() &&
                    start >= 0 && start < key_buffer.size(2),
                "DecoderLayer.decode: the cache's buffers do not hold this batch's token ", start);
    // Attention (Qwen3VLTextAttention.forward): q/k/v, their norms, rotary, the cache, the attention.
    const at::Tensor normed = vlserve::rms_norm(hidden, input_norm, eps);
    const at::Tensor qkv_out = project(*qkv, normed.reshape({batch, width}), dtype);
    const at::Tensor q = qkv_out.narrow(1, 0, q_width).contiguous().view({batch, 1, heads, head_dim});
    const at::Tensor k = qkv_out.narrow(1, q_width, kv_width).contiguous().view({batch, 1, kv_heads, head_dim});
    const at::Tensor v = qkv_out.narrow(1, q_width + kv_width, kv_width).view({batch, 1, kv_heads, head_dim});
    const auto rotated = vlserve::rotary(vlserve::rms_norm(q, q_norm, eps).transpose(1, 2),
                                         vlserve::rms_norm(k, k_norm, eps).transpose(1, 2), cos, sin);
    key_buffer.narrow(2, start, 1).copy_(std::get<1>(rotated));
    value_buffer.narrow(2, start, 1).copy_(v.transpose(1, 2));
    const at::Tensor attended = vlserve::one_query_attention(
        std::get<0>(rotated), key_buffer.narrow(2, 0, start + 1), value_buffer.narrow(2, 0, start + 1), mask, scale);
    const at::Tensor attention_out = project(*o, attended.reshape({batch, q_width}), dtype);
    const at::Tensor after_attention = hidden + attention_out.view({batch, 1, width});
    // MLP (Qwen3VLTextMLP.forward): down(silu(gate) * up).
    const at::Tensor gate_up_out =
        project(*gate_up, vlserve::rms_norm(after_attention, post_norm, eps).reshape({batch, width}), dtype);
    // vlserve::silu_mul is at::silu(gate) * up to the bit, in one pass where those take two copies and
    // three calls: 33 us of each layer at four sequences against 14 (2-vCPU Zen 4).
    const at::Tensor activated =
        vlserve::silu_mul_exact(batch * intermediate)
            ? vlserve::silu_mul(gate_up_out)
            : at::silu(gate_up_out.narrow(1, 0, intermediate).contiguous()) *
                  gate_up_out.narrow(1, intermediate, intermediate).contiguous();
    const at::Tensor mlp_out = project(*down, activated, dtype);
    return after_attention + mlp_out.view({batch, 1, width});
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(vlserve, lib) {
  lib.class_<Product>("Product")
      .def(torch::init<int64_t, std::vector<at::Tensor>, c10::optional<at::Tensor>, int64_t, c10::optional<at::Tensor>,
                       c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                       c10::optional<at::Tensor>>());
  lib.class_<DecoderLayer>("DecoderLayer")
      .def(torch::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, double, c10::intrusive_ptr<Product>,
                       c10::intrusive_ptr<Product>, c10::intrusive_ptr<Product>, c10::intrusive_ptr<Product>, int64_t,
                       int64_t, int64_t, int64_t, double, int64_t, std::string>())
      .def("decode", &DecoderLayer::decode);
}
