"""``nn.MultiheadAttention`` with its projections through :func:`fused_linear` and its attention
dropout from each member's own stream.

torch's ``multi_head_attention_forward`` projects a ``[T, N, E]`` input with ``F.linear``. Under
``vmap`` that input is ``[B, T, N, E]`` against ``[B, 3E, E]`` weights, which ``vmap`` batches as
a matmul broadcast over ``B x T``: ``B * T`` small products, and a weight gradient built as a
``[B, T, 3E, E]`` tensor before it is summed. Here each projection is one batched product over
``[B, T * N, E]``. The rest (``add_bias_kv``, ``add_zero_attn``, masks, scaled dot-product
attention, the averaged weights) follows torch's function step by step, so results agree with
``nn.MultiheadAttention`` to rounding.

The attention weights' dropout (``dropout=``, a float in torch's layer) is per member here, like
a fused ``nn.Dropout``'s ``p``: the array keeps it in ``member_p`` with the member's stream
(``member_seed``, ``member_calls``), so members may differ in it and each draws the masks it
draws alone. While no member's is above 0 (``hfsweep_masks`` false) no mask is drawn at all.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._dropout import apply_multiplier, stream_multiplier
from ._linear import fused_linear

__all__ = ["FusedMultiheadAttentionMixin"]


class FusedMultiheadAttentionMixin(nn.Module):
    """Forward of ``nn.MultiheadAttention`` with one batched product per projection and
    per-member attention dropout (see the module docstring)."""

    embed_dim: int
    num_heads: int
    dropout: float
    batch_first: bool
    _qkv_same_embed_dim: bool
    in_proj_weight: Tensor | None
    in_proj_bias: Tensor | None
    q_proj_weight: Tensor | None
    k_proj_weight: Tensor | None
    v_proj_weight: Tensor | None
    bias_k: Tensor | None
    bias_v: Tensor | None
    add_zero_attn: bool
    out_proj: nn.Linear
    #: whether some member's attention dropout is above 0 (set by the array)
    hfsweep_masks: bool = False

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        is_batched = query.dim() == 3
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask,
            mask_name="key_padding_mask",
            other_type=F._none_or_dtype(attn_mask),
            other_name="attn_mask",
            target_type=query.dtype,
        )
        attn_mask = F._canonical_mask(
            mask=attn_mask,
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=query.dtype,
            check_other=False,
        )
        if self.batch_first and is_batched:
            # the identities query is key is value choose the projection below: keep them
            if key is value:
                if query is key:
                    query = key = value = query.transpose(1, 0)
                else:
                    query, key = (x.transpose(1, 0) for x in (query, key))
                    value = key
            else:
                query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        out, weights = self._attend(
            query, key, value, key_padding_mask, need_weights, attn_mask, average_attn_weights,
            is_causal,
        )  # fmt: skip
        if self.batch_first and is_batched:
            out = out.transpose(1, 0)
        return out, weights

    def _attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        need_weights: bool,
        attn_mask: Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """``F.multi_head_attention_forward`` for sequence-first inputs whose masks
        :meth:`forward` has made canonical (float), without its ``static_k``/``static_v``
        (which the module never passes)."""
        heads = self.num_heads
        is_batched = F._mha_shape_check(  # type: ignore[attr-defined]
            query, key, value, key_padding_mask, attn_mask, heads
        )
        if not is_batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        tgt_len, bsz, embed_dim = query.shape
        src_len = key.shape[0]
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                "module method `generate_square_subsequent_mask` to create this mask."
            )
        masks = self.training and self.hfsweep_masks
        # The attention weights are formed explicitly when they are returned, and in training
        # always, so that a member computes the same way whether or not others drop out.
        explicit = need_weights or self.training
        if is_causal and key_padding_mask is None and not explicit:
            attn_mask = None  # SDPA applies the causal mask itself
        elif key_padding_mask is not None:
            is_causal = False  # the merged mask is not causal any more
        if embed_dim != self.embed_dim:
            raise AssertionError(
                f"was expecting embedding dimension of {self.embed_dim}, but got {embed_dim}"
            )
        head_dim = embed_dim // heads
        q, k, v = self._project(query, key, value)
        if attn_mask is not None:
            if attn_mask.dim() == 2:
                if attn_mask.shape != (tgt_len, src_len):
                    raise RuntimeError(
                        f"The shape of the 2D attn_mask is {attn_mask.shape}, but should be "
                        f"{(tgt_len, src_len)}."
                    )
                attn_mask = attn_mask.unsqueeze(0)
            elif attn_mask.dim() == 3:
                if attn_mask.shape != (bsz * heads, tgt_len, src_len):
                    raise RuntimeError(
                        f"The shape of the 3D attn_mask is {attn_mask.shape}, but should be "
                        f"{(bsz * heads, tgt_len, src_len)}."
                    )
            else:
                raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.repeat(1, bsz, 1)])
            v = torch.cat([v, self.bias_v.repeat(1, bsz, 1)])
            attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, 1))
        q = q.reshape(tgt_len, bsz * heads, head_dim).transpose(0, 1)
        k = k.reshape(k.shape[0], bsz * heads, head_dim).transpose(0, 1)
        v = v.reshape(v.shape[0], bsz * heads, head_dim).transpose(0, 1)
        if self.add_zero_attn:
            zeros = k.new_zeros(bsz * heads, 1, head_dim)
            k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
            attn_mask = F.pad(attn_mask, (0, 1)) if attn_mask is not None else None
            if key_padding_mask is not None:
                key_padding_mask = F.pad(key_padding_mask, (0, 1))
        src_len = k.size(1)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (bsz, src_len):
                raise AssertionError(
                    f"Expected key_padding_mask of shape {(bsz, src_len)} (batch, source "
                    f"length), got {tuple(key_padding_mask.shape)}"
                )
            key_padding_mask = (
                key_padding_mask.view(bsz, 1, 1, src_len)
                .expand(-1, heads, -1, -1)
                .reshape(bsz * heads, 1, src_len)
            )
            attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        weight, bias = self.out_proj.weight, self.out_proj.bias
        if explicit:
            q_scaled = q * math.sqrt(1.0 / float(head_dim))
            if attn_mask is not None:
                scores = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
            else:
                scores = torch.bmm(q_scaled, k.transpose(-2, -1))
            if need_weights:
                scores = F.softmax(scores, dim=-1)  # as torch: NaN where every key is masked
            else:
                # as SDPA: a query whose every key is masked attends to nothing (zeros)
                # (filled before the softmax too, so no NaN reaches the backward)
                empty = (scores == float("-inf")).all(dim=-1, keepdim=True)
                scores = F.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
            if masks:
                # a member with p = 0 counts no call, as it would alone (where no mask is drawn)
                multiplier = stream_multiplier(
                    self, tuple(scores.shape), scores.dtype, only_if_dropping=True
                )
                scores = apply_multiplier(scores, multiplier)
            out = torch.bmm(scores, v).transpose(0, 1).reshape(tgt_len * bsz, embed_dim)
            out = fused_linear(out, weight, bias).view(tgt_len, bsz, -1)
            if not need_weights:
                return (out if is_batched else out.squeeze(1)), None
            weights = scores.view(bsz, heads, tgt_len, src_len)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not is_batched:
                out, weights = out.squeeze(1), weights.squeeze(0)
            return out, weights
        if attn_mask is not None:
            if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0)
            else:
                attn_mask = attn_mask.view(bsz, heads, -1, src_len)
        q = q.view(bsz, heads, tgt_len, head_dim)
        k = k.view(bsz, heads, src_len, head_dim)
        v = v.view(bsz, heads, src_len, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal)
        out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, embed_dim)
        out = fused_linear(out, weight, bias).view(tgt_len, bsz, -1)
        return (out if is_batched else out.squeeze(1)), None

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The in-projections, one product for the inputs that are the same tensor."""
        e = self.embed_dim
        b = self.in_proj_bias
        if not self._qkv_same_embed_dim:
            assert self.q_proj_weight is not None and self.k_proj_weight is not None
            assert self.v_proj_weight is not None
            bq, bk, bv = b.chunk(3) if b is not None else (None, None, None)
            return (
                fused_linear(query, self.q_proj_weight, bq),
                fused_linear(key, self.k_proj_weight, bk),
                fused_linear(value, self.v_proj_weight, bv),
            )
        w = self.in_proj_weight
        assert w is not None
        if key is value and query is key:
            q, k, v = fused_linear(query, w, b).unflatten(-1, (3, e)).unbind(-2)
            return q, k, v
        if key is value:
            w_q, w_kv = w.split([e, 2 * e])
            b_q, b_kv = b.split([e, 2 * e]) if b is not None else (None, None)
            k, v = fused_linear(key, w_kv, b_kv).unflatten(-1, (2, e)).unbind(-2)
            return fused_linear(query, w_q, b_q), k, v
        w_q, w_k, w_v = w.chunk(3)
        b_q, b_k, b_v = b.chunk(3) if b is not None else (None, None, None)
        return (
            fused_linear(query, w_q, b_q),
            fused_linear(key, w_k, b_k),
            fused_linear(value, w_v, b_v),
        )
