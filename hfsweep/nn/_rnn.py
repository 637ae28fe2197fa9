"""LSTM, GRU and Elman RNN written out step by step, so that ``vmap`` can batch them.

``aten::lstm`` and ``aten::gru`` have no batching rule. These mixins compute the same recurrences
as torch's CPU kernels from the module's own parameters (``weight_ih_l0``, ``weight_hh_l0_reverse``,
``weight_hr_l0``...), so state dicts are interchangeable with the torch modules.

The dropout between layers (``num_layers > 1, dropout > 0``) is ``F.dropout``, which a fused
array routes to each member's own seeded stream (``hfsweep.fusion._random``): a member draws the
same masks alone and in any array.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from .._errors import FusionError
from ._linear import fused_linear

__all__ = ["FusedRNNMixin"]


class FusedRNNMixin(nn.Module):
    """Forward of ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` (any layers, bidirectional, projections)."""

    mode: str
    input_size: int
    hidden_size: int
    num_layers: int
    bias: bool
    batch_first: bool
    dropout: float
    bidirectional: bool
    proj_size: int
    nonlinearity: str

    def forward(
        self, input: Tensor, hx: Tensor | tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor | tuple[Tensor, Tensor]]:
        if isinstance(input, PackedSequence):
            raise FusionError(
                f"{type(self).__name__}: PackedSequence input is not supported in a fused array; "
                "pad the sequences (and mask the loss) instead"
            )
        is_lstm = self.mode == "LSTM"
        unbatched = input.dim() == 2
        if unbatched:
            input = input.unsqueeze(1)
        elif self.batch_first:
            input = input.transpose(0, 1)
        batch = input.shape[1]
        dirs = 2 if self.bidirectional else 1
        out_size = self.proj_size if self.proj_size > 0 else self.hidden_size
        h0, c0 = self._initial_state(hx, unbatched, batch, dirs, out_size, input)

        layer_input = input
        h_n: list[Tensor] = []
        c_n: list[Tensor] = []
        for layer in range(self.num_layers):
            outputs = []
            for d in range(dirs):
                idx = layer * dirs + d
                c_init = c0[idx] if c0 is not None else None
                out, h_last, c_last = self._run_direction(
                    layer_input, layer, d == 1, h0[idx], c_init
                )
                outputs.append(out)
                h_n.append(h_last)
                if c_last is not None:
                    c_n.append(c_last)
            layer_input = outputs[0] if dirs == 1 else torch.cat(outputs, dim=2)
            if self.dropout > 0 and self.training and layer < self.num_layers - 1:
                layer_input = F.dropout(layer_input, self.dropout, True)

        output = layer_input
        h = torch.stack(h_n)
        c = torch.stack(c_n) if is_lstm else None
        if unbatched:
            output, h = output.squeeze(1), h.squeeze(1)
            c = c.squeeze(1) if c is not None else None
        elif self.batch_first:
            output = output.transpose(0, 1)
        if is_lstm:
            assert c is not None
            return output, (h, c)
        return output, h

    def _initial_state(
        self,
        hx: Tensor | tuple[Tensor, Tensor] | None,
        unbatched: bool,
        batch: int,
        dirs: int,
        out_size: int,
        input: Tensor,
    ) -> tuple[Tensor, Tensor | None]:
        is_lstm = self.mode == "LSTM"
        n = self.num_layers * dirs
        if hx is None:
            h0 = input.new_zeros(n, batch, out_size)
            c0 = input.new_zeros(n, batch, self.hidden_size) if is_lstm else None
            return h0, c0
        if is_lstm:
            if not isinstance(hx, tuple):
                raise FusionError("LSTM: hx must be a tuple (h_0, c_0)")
            h0, c0 = hx
            if unbatched:
                h0, c0 = h0.unsqueeze(1), c0.unsqueeze(1)
            return h0, c0
        assert isinstance(hx, Tensor)
        return (hx.unsqueeze(1) if unbatched else hx), None

    def _run_direction(
        self, x: Tensor, layer: int, reverse: bool, h: Tensor, c: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        sfx = f"_l{layer}" + ("_reverse" if reverse else "")
        w_ih: Tensor = getattr(self, "weight_ih" + sfx)
        w_hh: Tensor = getattr(self, "weight_hh" + sfx)
        b_ih: Tensor | None = getattr(self, "bias_ih" + sfx) if self.bias else None
        b_hh: Tensor | None = getattr(self, "bias_hh" + sfx) if self.bias else None
        w_hr: Tensor | None = getattr(self, "weight_hr" + sfx) if self.proj_size > 0 else None
        gates_x = fused_linear(x, w_ih, b_ih)  # [T, N, G]: input projections for all steps at once
        steps = range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])
        outs: list[Tensor] = [x.new_empty(0)] * x.shape[0]
        for t in steps:
            gates_h = fused_linear(h, w_hh, b_hh)
            if self.mode == "LSTM":
                assert c is not None
                i, f, g, o = (gates_x[t] + gates_h).chunk(4, dim=-1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                if w_hr is not None:
                    h = fused_linear(h, w_hr, None)
            elif self.mode == "GRU":
                xr, xz, xn = gates_x[t].chunk(3, dim=-1)
                hr, hz, hn = gates_h.chunk(3, dim=-1)
                r = torch.sigmoid(xr + hr)
                z = torch.sigmoid(xz + hz)
                n = torch.tanh(xn + r * hn)
                h = (1 - z) * n + z * h
            else:
                pre = gates_x[t] + gates_h
                h = torch.tanh(pre) if self.nonlinearity == "tanh" else torch.relu(pre)
            outs[t] = h
        return torch.stack(outs), h, c
