"""Quantized weights: the block formats q8_0, q4_0, q4_1, q5_0, q5_1, GGUF's K-quants
q4_k, q5_k and q6_k, and w8a8 (int8 per channel).

A `QuantizedWeight` is an [N, K] matrix stored as blocks of 32 weights along K, one
fp16 scale each (and a minimum where the source had one), repacked at load into one
array per part so that each kernel reads its part contiguously:

    qs  uint8 [N, K/32, 16]  4-bit: element j of a block in byte j's low nibble,
                             element j + 16 in its high nibble (as GGUF has them)
    qh  int32 [N, K/32]      5-bit only: bit j is element j's fifth (high) bit
        uint8 [N, K/32, 32]  8-bit: stored + 128, so that every weight byte is unsigned
    d   float16 [N, K/32]    the block's scale
    m   float16 [N, K/32]    the block's minimum: always for q4_1, optional for q8_0
                             (5-bit sources with a minimum), else None

    weight = d * (q - offset) + m      offset: 8 (q4_0), 16 (q5_0), 128 (q8_0), 0 (q4_1, q5_1)

The K-quants keep GGUF's super-blocks of 256 weights (one fp16 scale, and integer
scales for each 32 or 16 weights under it), so they take as many bits as in the file
(4.625, 5.625 and 6.5625 a weight: the 6-bit scales of q4_k and q5_k unpacked to a
byte each) and K must be a multiple of 256:

    q4_k  qs as 4-bit above; d, m float16 [N, K/256] (the super-block's d and dmin);
          sc uint8 [N, K/32, 2] (each 32's 6-bit scale and minimum)
          weight = d * sc[0] * q - m * sc[1]
    q5_k  as q4_k, with qh int32 [N, K/32] as q5's: bit j is element j's fifth bit
    q6_k  qs as 4-bit above (the low four bits); qh uint8 [N, K/128, 32] (the high two
          bits of 128 weights: byte i holds, from bit 0, those of elements i and i + 32
          of the low nibbles in the four blocks' qs, then i and i + 32 of the high ones);
          d float16 [N, K/256]; sc int8 [N, K/32, 2] (the scales of elements 0-15, 16-31)
          weight = d * sc[j // 16] * (q - 32)

`w8a8` is W8A8 as vLLM has it (without SmoothQuant's calibration), made at load from
float weights: qs int8 [N, K], d float32 [N] (one scale per output channel),
weight = d * q; its kernels quantize the activations per row (not per block of 32)
and multiply integers, which oneDNN's integer GEMM can do for large batches.

Every quantized GGUF type loads into one of them (`from_gguf`): Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q4_K, Q5_K and Q6_K as they are; any other type (Q2_K, Q3_K, IQ*) is
requantized to q8_0, which adds at most half an 8-bit step to each weight. The kernels
(pagoda.ops) run linear layers on the blocks directly; nothing is expanded to a float
matrix in memory except, transiently, for a prefill-sized product.

4-bit GPTQ and AWQ checkpoints (`from_gptq`, `from_awq`: groups of 32, 64, 128 ... weights
along K, each with an fp16 scale and a 4-bit zero point) load into the same blocks:
symmetric ones (every zero point 8) into q4_0 exactly, others into q4_1 with the
minimum -scale * zero rounded once to fp16.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # weights per block, every format
# Block formats; index = the C++ kernels' format code.
FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q6_k", "q5_k")
SUPER_BLOCK = 256  # weights per K-quant super-block
K_QUANTS = ("q4_k", "q5_k", "q6_k")
PER_CHANNEL = "w8a8"
OFFSETS = {"q8_0": 128, "q4_0": 8, "q4_1": 0, "q5_0": 16, "q5_1": 0,
           "q4_k": 0, "q5_k": 0, "q6_k": 32}  # fmt: skip
# GGUF's raw block: (format, fp16 fields, bytes of high bits, quant bytes), in that order.
_GGUF_LAYOUT = {
    "Q8_0": ("q8_0", 1, 0, 32), "Q4_0": ("q4_0", 1, 0, 16), "Q4_1": ("q4_1", 2, 0, 16),
    "Q5_0": ("q5_0", 1, 4, 16), "Q5_1": ("q5_1", 2, 4, 16),
}  # fmt: skip
# GGUF tensor types that hold floats or integers, not blocks: never kept quantized.
GGUF_PLAIN_TYPES = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})


@dataclass
class QuantizedWeight:
    format: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    qh: torch.Tensor | None = None  # q5_0, q5_1, q5_k, q6_k
    sc: torch.Tensor | None = None  # the K-quants

    @property
    def shape(self) -> tuple[int, int]:
        if self.format == PER_CHANNEL:
            return self.qs.shape[0], self.qs.shape[1]
        return self.qs.shape[0], self.qs.shape[1] * BLOCK

    @property
    def format_code(self) -> int:
        return FORMATS.index(self.format)

    TENSOR_FIELDS = ("qs", "d", "m", "qh", "sc")  # (a ClassVar: no annotation)

    def parts(self) -> tuple[torch.Tensor | None, ...]:
        """qs, d, m, qh, sc: the fields that hold tensors, in the constructor's order."""
        return tuple(getattr(self, field) for field in self.TENSOR_FIELDS)

    def map(self, fn) -> QuantizedWeight:
        """The same weight with `fn` applied to each of its tensors (a gather, a copy)."""
        return QuantizedWeight(self.format, *(None if t is None else fn(t) for t in self.parts()))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts() if t is not None)

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The weight's rows `index` (a gather: an embedding lookup, a row permutation)."""
        return self.map(lambda t: t[index])

    def columns(self, start: int, end: int) -> QuantizedWeight:
        """The weight's columns [start, end) (a row-parallel shard): whole blocks only.
        A K-quant cut inside its super-blocks (tensor parallel on Llama-2-7B's 11,008
        or Qwen2.5-7B's 28 heads) comes in blocks of 32 (`in_blocks_of_32`)."""
        if self.format == PER_CHANNEL:  # one scale per row: every column keeps it
            return QuantizedWeight(self.format, self.qs[:, start:end].contiguous(), self.d)
        if start % BLOCK or end % BLOCK:
            raise ValueError(
                f"columns {start}:{end} of a {self.format} weight cut its blocks of {BLOCK}."
            )
        if self.format in K_QUANTS and (start % SUPER_BLOCK or end % SUPER_BLOCK):
            return self.in_blocks_of_32().columns(start, end)
        k = self.shape[1]

        def part(t: torch.Tensor) -> torch.Tensor:
            per = k // t.shape[1]  # weights along K per index of this part's dim 1
            return t[:, start // per : end // per].contiguous()

        return self.map(part)

    def codes(self) -> torch.Tensor:
        """The integer codes q, int16 [N, K/32, 32] (block formats)."""
        if self.format == "q8_0":
            return self.qs.to(torch.int16)
        codes = torch.cat((self.qs & 0x0F, self.qs >> 4), -1).to(torch.int16)
        if self.format == "q6_k":  # the high two bits, four fields a byte (see above)
            shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
            fields = (self.qh.unsqueeze(-2) >> shifts) & 3  # [N, K/128, 4, 32]
            n, groups = fields.shape[:2]
            low, high = fields[:, :, :2].reshape(n, groups, 4, 16), fields[:, :, 2:]
            high = torch.cat((low, high.reshape(n, groups, 4, 16)), -1)
            codes = codes | (high.reshape(codes.shape).to(torch.int16) << 4)
        elif self.qh is not None:  # bit j of qh: element j's fifth bit
            bits = (self.qh.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
            codes = codes | (bits.to(torch.int16) << 4)
        return codes

    def dequantized(self) -> torch.Tensor:
        """The weights in float32, [N, K], as the `gguf` package (and llama.cpp)
        dequantize them: (q - offset) * d + m, each product exact, one rounding."""
        if self.format == PER_CHANNEL:
            return self.qs.float() * self.d.unsqueeze(1)
        codes = self.codes()
        if self.format in ("q4_k", "q5_k"):  # d * sc * q - dmin * m, in float32
            scale, minimum = self._block_scale_and_minimum()
            w = scale.unsqueeze(-1) * codes - minimum.unsqueeze(-1)
        elif self.format == "q6_k":  # d * sc * (q - 32), a scale per 16
            scale = _per_block(self.d).unsqueeze(-1) * self.sc
            w = scale.unsqueeze(-1) * (codes - 32).view(*codes.shape[:2], 2, 16)
        else:
            w = (codes - OFFSETS[self.format]).float() * self.d.float().unsqueeze(-1)
            if self.m is not None:
                w = w + self.m.float().unsqueeze(-1)
        return w.reshape(self.shape)

    def widened(self) -> QuantizedWeight:
        """The same weights in q8_0 (exact: a 4- or 5-bit code is an 8-bit one)."""
        if self.format == "q8_0":
            return self
        if self.format == PER_CHANNEL or self.format in K_QUANTS:
            raise ValueError(f"{self.format} weights are not widened to q8_0")
        qs = (self.codes() - OFFSETS[self.format] + OFFSETS["q8_0"]).to(torch.uint8)
        return QuantizedWeight("q8_0", qs, self.d, self.m)

    def in_blocks_of_32(self) -> QuantizedWeight:
        """A K-quant in 32-weight blocks (as pagoda loaded them before it kept
        super-blocks): q4_k and q5_k in q4_1 and q5_1, their codes kept and each 32's
        scale d * sc and minimum dmin * mn rounded once to fp16 (half a bit a weight
        more); q6_k, a scale per 16, requantized to q8_0 (two bits more)."""
        if self.format == "q6_k":
            return requantized_q8_0(self.dequantized().numpy())
        if self.format not in K_QUANTS:
            return self
        scale, minimum = self._block_scale_and_minimum()
        fmt = "q4_1" if self.format == "q4_k" else "q5_1"
        return QuantizedWeight(fmt, self.qs, scale.half(), (-minimum).half(), self.qh)

    def _block_scale_and_minimum(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q4_k/q5_k: each block's scale d * sc and minimum dmin * mn, float32 [N, K/32]
        (weight = scale * q - minimum), rounded as the gguf package rounds them."""
        return _per_block(self.d) * self.sc[..., 0], _per_block(self.m) * self.sc[..., 1]

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight | StackedWeight:
        """Stack weights along N (fused q/k/v, gate/up). Where a K-quant meets another
        format (a Q4_K_M file's Q4_K q and k with its Q6_K v), each run of one format is
        stacked and the runs stay apart in a StackedWeight; other formats are all
        widened to q8_0 first, exactly."""
        formats = {p.format for p in parts}
        if len(formats) > 1 and formats & set(K_QUANTS):
            runs = itertools.groupby(parts, key=lambda p: p.format)
            return StackedWeight([QuantizedWeight.cat(list(run)) for _, run in runs])
        if len(formats) > 1:
            parts = [p.widened() for p in parts]
        m = None
        if any(p.m is not None for p in parts):
            m = torch.cat([p.m if p.m is not None else torch.zeros_like(p.d) for p in parts])
        qh = torch.cat([p.qh for p in parts]) if parts[0].qh is not None else None
        sc = torch.cat([p.sc for p in parts]) if parts[0].sc is not None else None
        qs, d = torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts])
        return QuantizedWeight(parts[0].format, qs, d, m, qh, sc)


def _per_block(t: torch.Tensor) -> torch.Tensor:
    """A K-quant's value per super-block [N, K/256] (d, dmin) as float32 per block of
    32 [N, K/32]."""
    return t.float().repeat_interleave(SUPER_BLOCK // BLOCK, 1)


@dataclass
class StackedWeight:
    """A fused weight (q/k/v, gate/up) whose parts differ in format, each kept in its
    own: a product runs per part and lays the outputs side by side, as one product on
    the stacked matrix would. (Widening them to one format would cost a Q4_K_M file's
    q/k/v 8.5 bits a weight where they have 4.6 and 6.6.)"""

    pieces: list[QuantizedWeight]

    @property
    def format(self) -> str:
        return "+".join(p.format for p in self.pieces)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.pieces), self.pieces[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def parts(self) -> tuple[torch.Tensor | None, ...]:
        return tuple(t for p in self.pieces for t in p.parts())

    def map(self, fn) -> StackedWeight:
        return StackedWeight([p.map(fn) for p in self.pieces])

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.pieces])

    def split(self, bias: torch.Tensor | None):
        """(piece, its slice of `bias` or None) for each piece, in order."""
        start = 0
        for p in self.pieces:
            end = start + p.shape[0]
            yield p, None if bias is None else bias[start:end]
            start = end


def quantize_per_channel(w: torch.Tensor) -> QuantizedWeight:
    """A float [N, K] weight as int8 with one scale per row: d = max|w| / 127."""
    w = w.float()
    d = w.abs().amax(dim=1) / 127.0
    q = torch.round(w / torch.where(d > 0, d, 1.0).unsqueeze(1)).to(torch.int8)
    return QuantizedWeight(PER_CHANNEL, q.contiguous(), d.contiguous())


def from_gguf(type_name: str, data: np.ndarray) -> QuantizedWeight:
    """A GGUF tensor's raw blocks (uint8 [rows, blocks * block bytes]) as pagoda's blocks."""
    if type_name in _GGUF_LAYOUT:
        return _repack(type_name, data)
    if type_name in ("Q4_K", "Q5_K"):
        return _repack_q4_k(data, fifth_bits=type_name == "Q5_K")
    if type_name == "Q6_K":
        return _repack_q6_k(data)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    ggml_type = GGMLQuantizationType[type_name]
    return requantized_q8_0(dequantize(np.ascontiguousarray(data), ggml_type))


def requantized_q8_0(w: np.ndarray) -> QuantizedWeight:
    """Float weights [N, K] in q8_0, by the `gguf` package's own quantizer."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return _repack("Q8_0", quantize(w.astype(np.float32, copy=False), GGMLQuantizationType.Q8_0))


def _super_blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    rows = data.shape[0]
    return np.ascontiguousarray(data).reshape(rows, -1, block_bytes)  # [rows, K/256, bytes]


def _nibbles(codes: np.ndarray) -> torch.Tensor:
    """4-bit codes [rows, K] (low four bits used) as qs: per block of 32, element j in
    byte j's low nibble and j + 16 in its high one."""
    blocks = codes.reshape(codes.shape[0], -1, BLOCK) & 0x0F
    return torch.from_numpy(blocks[:, :, :16] | (blocks[:, :, 16:] << 4))


def _repack_q4_k(data: np.ndarray, fifth_bits: bool = False) -> QuantizedWeight:
    """GGUF's Q4_K super-block (d, dmin, 12 bytes of 6-bit scales and minimums, then
    128 bytes: weights 64 i + l and 64 i + 32 + l in byte 32 i + l's nibbles), or
    Q5_K's (32 bytes before the nibbles: bit i of byte l is weight 32 i + l's fifth)."""
    from gguf.quants import Q4_K

    raw = _super_blocks(data, 176 if fifth_bits else 144)
    rows, count = raw.shape[:2]
    halves = raw[:, :, :4].copy().view(np.float16)  # [rows, K/256, 2]
    sc, mn = Q4_K.get_scale_min(raw[:, :, 4:16].reshape(-1, 12))  # [rows * K/256, 8] each
    packed = raw[:, :, 48 if fifth_bits else 16 :].reshape(rows, count, 4, 1, 32)
    codes = (packed >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F
    scales = np.stack((sc, mn), -1).reshape(rows, count * 8, 2).astype(np.uint8)
    qh = None
    if fifth_bits:  # as q5's qh: per block of 32, bit j is element j's fifth bit
        bits = (raw[:, :, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [.., l, i]
        bits = bits.transpose(0, 1, 3, 2).astype(np.uint32)  # [rows, K/256, block, l]
        qh = (bits << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32)
        qh = torch.from_numpy(qh.reshape(rows, -1).view(np.int32))
    return QuantizedWeight(
        "q5_k" if fifth_bits else "q4_k",
        _nibbles(codes.reshape(rows, -1)),
        torch.from_numpy(np.ascontiguousarray(halves[:, :, 0])),
        torch.from_numpy(np.ascontiguousarray(halves[:, :, 1])),
        qh,
        torch.from_numpy(scales),
    )


def _repack_q6_k(data: np.ndarray) -> QuantizedWeight:
    """GGUF's Q6_K super-block (128 bytes of low nibbles, 64 of high bit pairs, 16 int8
    scales, d), as the gguf package reads it: per half of 128 weights, element l + 32 f
    takes nibble f // 2 of ql byte l + 32 (f % 2) and bit pair f of qh byte l."""
    raw = _super_blocks(data, 210)
    rows, count = raw.shape[:2]
    ql = raw[:, :, :128].reshape(rows, count, 2, 1, 64)
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F  # [.., 2, 2, 64]
    qh = raw[:, :, 128:192].reshape(rows, count, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3  # [.., 2, 4, 32]
    codes = (low.reshape(rows, count, 2, 4, 32) | (high << 4)).reshape(rows, -1)
    # The high bits in the kernel's order: per 4 blocks, the low nibbles' positions
    # (block b, element j < 16: 16 b + j) then the high nibbles' (element j + 16).
    fields = (codes >> 4).reshape(rows, -1, 4, 2, 16).transpose(0, 1, 3, 2, 4)
    fields = fields.reshape(rows, -1, 4, 32)  # [rows, K/128, (low 0-31, 32-63, high ...)]
    qh_packed = fields[:, :, 0] | fields[:, :, 1] << 2 | fields[:, :, 2] << 4 | fields[:, :, 3] << 6
    scales = raw[:, :, 192:208].copy().view(np.int8).reshape(rows, count * 8, 2)
    return QuantizedWeight(
        "q6_k",
        _nibbles(codes),
        torch.from_numpy(raw[:, :, 208:210].copy().view(np.float16)[:, :, 0]),
        qh=torch.from_numpy(np.ascontiguousarray(qh_packed)),
        sc=torch.from_numpy(scales),
    )


def _repack(type_name: str, data: np.ndarray) -> QuantizedWeight:
    fmt, num_halves, high_bytes, quant_bytes = _GGUF_LAYOUT[type_name]
    rows = data.shape[0]
    raw = np.ascontiguousarray(data).reshape(rows, -1, 2 * num_halves + high_bytes + quant_bytes)
    halves = raw[:, :, : 2 * num_halves].copy().view(np.float16)  # [rows, nb, num_halves]
    high = raw[:, :, 2 * num_halves : 2 * num_halves + high_bytes]
    qs = raw[:, :, 2 * num_halves + high_bytes :]
    if fmt == "q8_0":
        qs = (qs.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    d = torch.from_numpy(np.ascontiguousarray(halves[:, :, 0]))
    m = torch.from_numpy(np.ascontiguousarray(halves[:, :, 1])) if num_halves == 2 else None
    qh = None
    if high_bytes:  # a little-endian uint32 a block
        qh = torch.from_numpy(np.ascontiguousarray(high).view("<i4")[:, :, 0].astype(np.int32))
    return QuantizedWeight(fmt, torch.from_numpy(np.ascontiguousarray(qs)), d, m, qh)


# ---- GPTQ and AWQ ----------------------------------------------------------------------

_AWQ_COLUMN_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # AWQ packs columns 0,2,4,6,1,3,5,7 in bit order


def _unpack_int4(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding eight 4-bit values (value i at bits 4i) unpacked along `dim`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    if dim == 0:  # [R, C] -> [R * 8, C]
        values = (packed.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF
        return values.reshape(-1, packed.shape[1]).to(torch.uint8)
    values = (packed.unsqueeze(2) >> shifts.view(1, 1, 8)) & 0xF  # [R, C] -> [R, C * 8]
    return values.reshape(packed.shape[0], -1).to(torch.uint8)


def from_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    group_size: int,
    zeros_minus_one: bool = True,
) -> QuantizedWeight:
    """A 4-bit GPTQ linear (AutoGPTQ's format: qweight int32 [K/8, N] packed along K,
    qzeros int32 [G, N/8] packed along N, scales fp16 [G, N], g_idx [K]):
    weight[n, k] = scales[g, n] * (q[k, n] - zero[g, n]), g = g_idx[k], where the stored
    zero is one less than the zero point (`zeros_minus_one`; not in "gptq_v2" files)."""
    codes = _unpack_int4(qweight, 0)  # [K, N]
    zeros = _unpack_int4(qzeros, 1).to(torch.int16) + int(zeros_minus_one)  # [G, N]
    size = _group_size(group_size, codes.shape[0])
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(codes.shape[0]) // size):
        raise ValueError(
            "GPTQ with act-order (desc_act: groups not in input order) is not supported; "
            "requantize with desc_act false"
        )
    return _from_int4_groups(codes.T, zeros, scales, size)


def from_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> QuantizedWeight:
    """A 4-bit AWQ linear (AutoAWQ's GEMM format: qweight int32 [K, N/8] and qzeros
    int32 [G, N/8] packed along N in AWQ's column order, scales fp16 [G, N]):
    weight[n, k] = scales[g, n] * (q[k, n] - zeros[g, n]), g = k // group_size."""
    order = torch.tensor(_AWQ_COLUMN_NIBBLE)

    def unpack(packed: torch.Tensor) -> torch.Tensor:
        words = _unpack_int4(packed, 1).view(packed.shape[0], -1, 8)
        return words[:, :, order].reshape(packed.shape[0], -1)

    codes = unpack(qweight)  # [K, N]
    size = _group_size(group_size, codes.shape[0])
    return _from_int4_groups(codes.T, unpack(qzeros).to(torch.int16), scales, size)


def _group_size(group_size: int, k: int) -> int:
    size = k if group_size in (-1, 0) else group_size
    if size % BLOCK or k % size:
        raise ValueError(
            f"group_size {group_size} must be a multiple of {BLOCK} that divides the input size {k}"
        )
    return size


def _from_int4_groups(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> QuantizedWeight:
    """codes uint8 [N, K] in 0..15; zeros [G, N]; scales [G, N]: as 32-weight blocks."""
    n, k = codes.shape
    per_group = group_size // BLOCK
    scale = scales.T.float().repeat_interleave(per_group, dim=1)  # [N, K/32]
    zero = zeros.T.repeat_interleave(per_group, dim=1)
    blocks = codes.reshape(n, k // BLOCK, BLOCK)
    qs = (blocks[:, :, :16] | (blocks[:, :, 16:] << 4)).contiguous()
    d = scale.half().contiguous()
    if bool((zero == OFFSETS["q4_0"]).all()):  # symmetric: scale * (q - 8), exactly
        return QuantizedWeight("q4_0", qs, d)
    return QuantizedWeight("q4_1", qs, d, (-scale * zero).half().contiguous())
