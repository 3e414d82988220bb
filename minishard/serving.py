"""Serving: what one generated token costs, priced on any chip (the inference roofline).

Training reads each weight once for a whole batch of long sequences; decoding reads
each weight, and every sequence's whole KV cache, to make *one* token per sequence.
So a decode step is bound by HBM bandwidth until the batch is large, and the cache,
not the weights, soon decides what fits. Prefill (reading the prompt) is a training
forward pass: compute-bound. The formulas, for P parameters of ``w`` bytes each, B
sequences whose caches hold ``kv`` bytes each, on N chips of C FLOP/s and W bytes/s:

* KV cache per token: ``2 · bytes · kv_heads · head_dim · layers`` (keys and values), a
  ``Decoder``'s, each number of ``number_bytes`` in one of the ``FORMATS``;
* decode step (``decode_step_time``): ``B·kv / NW + max(2BP / NC, P·w / NW)``: attention
  reads each cache once per token (never compute-bound), the matmuls are the larger of
  FLOPs and weights;
* critical batch: the matmuls turn compute-bound at ``B = C·w / 2W`` (240 in bf16 on v5e);
* prefill of T tokens (``prefill_time``): ``2PT / NC``;
* tensor-parallel decode (``tensor_parallel_time``): two all-reduces of ``B x width``
  activations per layer;
* what fits (``cache_fits``): the sequences whose caches fit in HBM beside the weights, and
  ``latency_throughput``, a ``Point`` per batch size: slower steps, more tokens a second.

The shapes priced are published ones, ``SIZES`` by name: ``LLAMA2_13B``, ``LLAMA3_8B``,
``LLAMA3_70B``, ``LLAMA3_405B``, ``PALM_540B``, ``MEGATRON_1T``, ``MIXTRAL_8X7B`` (a mixture of
experts: each token runs 2 of its 8 MLPs), and ``MINISHARD_GPT``, minishard's own.

Sources: the scaling book's inference chapter (jax-ml/scaling-book, ``inference.md``):
its equations, its LLaMA-2 13B tables and pop quiz, which tests/test_serving.py reproduces.
The prices are bounds (perfect overlap, no kernel overheads); weights and caches in int8 or
int4 are priced by their bytes alone, no quantised kernel runs here.

>>> round(decode_critical_batch("v5e"), 1), round(decode_critical_batch("v5e", "int8"), 1)
(243.2, 121.6)
"""

from __future__ import annotations

import dataclasses

from minishard import _checks
from minishard.costs import collective_time, hbm_critical_batch
from minishard.hardware import Hardware, hardware_named
from minishard.memory import itemsize

# --- 1. the bytes: weights and the KV cache -----------------------------------------------------

FORMATS = ("float32", "bfloat16", "int8", "int4")
"""The number formats a weight or a cache entry is priced in."""


def number_bytes(precision: str) -> float:
    """Bytes of one weight or cache entry: ``memory.itemsize``'s, and half a byte for int4.

    >>> [number_bytes(name) for name in FORMATS]
    [4, 2, 1, 0.5]
    """
    _checks.one_of("precision", precision, FORMATS)
    return 0.5 if precision == "int4" else itemsize(precision)


@dataclasses.dataclass(frozen=True)
class Decoder:
    """A decoder-only transformer's shapes, as the pricing sees it (the book's names in
    brackets): ``layers`` (L), ``width`` (D), ``heads`` (N), ``kv_heads`` (K; fewer than
    ``heads`` under grouped-query attention), ``head_dim`` (H), ``hidden`` (F, a gated MLP's
    three matrices), ``vocab`` (V). GPT-2's shape differs in three ways (``MINISHARD_GPT``): an
    MLP of two matrices (``gated=False``), a learned position table of ``position_rows`` rows
    (0: rotary, no table), and ``biases`` (each LayerNorm's scale and bias, each MLP matrix's
    bias and the head's, where LLaMA has an RMSNorm's scale alone). A mixture of experts
    (``MIXTRAL_8X7B``) has ``experts`` MLPs a layer, of which each token runs ``top_k``, and a
    router (``D x experts``); 0 experts: a dense MLP.
    """

    layers: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    gated: bool = True
    position_rows: int = 0
    biases: bool = False
    experts: int = 0
    top_k: int = 0

    @property
    def params(self) -> int:
        """The book's count: a gated MLP (3DF), q and out (2DNH), k and v (2DKH) per layer, two
        embeddings; GPT-2's MLP is 2DF, its position table PD, and its biases 5D + F a layer and
        2D + V at the end; a mixture's every expert's MLP and its router (``expert_params``).

        >>> round(LLAMA2_13B.params / 1e9, 3), MINISHARD_GPT.params   # 816,193
        (13.015, 816193)
        """
        return self._count(max(self.experts, 1))

    @property
    def active_params(self) -> int:
        """The parameters one token computes with: a mixture's ``top_k`` experts of its ``experts``
        (Mixtral 8x7B's 12.9e9 of 46.7e9); every parameter of a dense model.

        >>> round(MIXTRAL_8X7B.params / 1e9, 1), round(MIXTRAL_8X7B.active_params / 1e9, 1)
        (46.7, 12.9)
        """
        return self._count(self.top_k if self.experts else 1)

    @property
    def expert_params(self) -> int:
        """The parameters of every layer's experts, which expert parallelism splits (0: dense)."""
        return self.layers * self._mlp * self.experts

    @property
    def _mlp(self) -> int:
        return (3 if self.gated else 2) * self.width * self.hidden

    def _count(self, mlps: int) -> int:
        """The parameters of a model whose layers hold ``mlps`` MLPs each, and a router if a
        mixture."""
        width = self.width
        attention = 2 * self.width * self.head_dim * (self.heads + self.kv_heads)
        mlp = self._mlp * mlps + width * self.experts  # the router: D x experts (0: dense)
        biases = (5 * width + self.hidden, 2 * width + self.vocab) if self.biases else (0, 0)
        embeddings = (2 * self.vocab + self.position_rows) * width + biases[1]
        return self.layers * (mlp + attention + biases[0]) + embeddings

    def kv_bytes_per_token(self, precision: str = "bfloat16") -> float:
        """Cache bytes per token of one sequence: ``2 · bytes · K · H · L``.

        >>> LLAMA2_13B.kv_bytes_per_token(), LLAMA2_13B.kv_bytes_per_token("int8")
        (819200, 409600)
        """
        return 2 * number_bytes(precision) * self.kv_heads * self.head_dim * self.layers


LLAMA2_13B = Decoder(  # F = 2.7 D; no grouped queries
    layers=40, width=5120, heads=40, kv_heads=40, head_dim=128, hidden=13824, vocab=32000
)
"""LLaMA-2 13B, as the scaling book's inference chapter lists it."""
LLAMA3_70B = Decoder(  # 8 KV heads
    layers=80, width=8192, heads=64, kv_heads=8, head_dim=128, hidden=28672, vocab=128256
)
"""LLaMA-3 70B, as the book's "Serving LLaMA 3-70B" lists it (``applied-inference.md``)."""
LLAMA3_8B = Decoder(  # 8 KV heads
    layers=32, width=4096, heads=32, kv_heads=8, head_dim=128, hidden=14336, vocab=128256
)
"""LLaMA-3 8B: the Llama 3 paper's Table 3 (Dubey et al. 2024), the vocabulary as released."""
LLAMA3_405B = Decoder(
    layers=126, width=16384, heads=128, kv_heads=8, head_dim=128, hidden=53248, vocab=128256
)
"""LLaMA-3 405B, from the same table."""
MINISHARD_GPT = Decoder(  # GPT-2's shape
    layers=4,
    width=128,
    heads=4,
    kv_heads=4,
    head_dim=32,
    hidden=512,
    vocab=65,
    gated=False,
    position_rows=64,
    biases=True,
)
"""minishard's own default GPT (``minishard.models.gpt``: nanoGPT's CPU shape, tiny_shakespeare's
65 characters), whose layouts ``explain --compare --size gpt --check`` compiles on 8 devices."""
PALM_540B = Decoder(  # multi-query: one K/V head
    layers=118, width=18432, heads=48, kv_heads=1, head_dim=256, hidden=73728, vocab=256000
)
"""PaLM 540B (Chowdhery et al. 2022, Table 1): SwiGLU, multi-query attention (one K/V head), a
256k vocabulary. Its input and output embeddings are one matrix, which ``params`` counts twice
(+4.7e9)."""
MEGATRON_1T = Decoder(
    layers=128,
    width=25600,
    heads=160,
    kv_heads=160,
    head_dim=160,
    hidden=4 * 25600,
    vocab=51200,
    gated=False,
    position_rows=2048,
    biases=True,
)
"""The GPT of 1 trillion parameters Narayanan et al. 2021 (Megatron-LM, Table 1) ran on 3,072
A100: GPT-2's shape, a 51,200-token vocabulary and sequences of 2,048."""
MIXTRAL_8X7B = Decoder(
    layers=32,
    width=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    hidden=14336,
    vocab=32000,
    experts=8,
    top_k=2,
)
"""Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", Table 1): Mistral 7B's shape with 8
experts a layer, each token routed to 2: 46.7e9 parameters, 12.9e9 active a token (its §2)."""
SIZES = {
    "llama2-13b": LLAMA2_13B,
    "llama3-8b": LLAMA3_8B,
    "llama3-70b": LLAMA3_70B,
    "llama3-405b": LLAMA3_405B,
    "palm-540b": PALM_540B,
    "megatron-1t": MEGATRON_1T,
    "mixtral-8x7b": MIXTRAL_8X7B,
    "gpt": MINISHARD_GPT,
}
"""The named sizes ``minishard explain --size`` prices: serving (``--decode``), training
(``--compare``)."""

# --- 2. the roofline of one decode step ---------------------------------------------------------


def decode_critical_batch(hardware: Hardware | str, weights: str = "bfloat16") -> float:
    """Sequences in a batch above which a decode step's matmuls are compute-bound:
    ``costs.hbm_critical_batch`` of ``weights``' bytes (a token a sequence). int8 weights with bf16
    FLOPs halve it (the book's 240 and 120 on a v5e)."""
    return hbm_critical_batch(hardware, number_bytes(weights))


def decode_step_time(
    params: float,
    kv_bytes: float,
    batch: int,
    chips: int,
    hardware: Hardware | str,
    weights: str = "bfloat16",
) -> float:
    """Seconds of one decode step of ``batch`` sequences, each with a cache of ``kv_bytes``, on
    ``chips``.

    The book's general bound: attention reads every cache (``B·kv / NW``, never compute-bound),
    then the matmuls take the larger of their FLOPs and their weights' reads. (The plain
    roofline ``max(2BP/NC, (P·w + B·kv)/NW)`` assumes the cache reads hide under the
    matmuls' FLOPs; it is lower once the batch passes the critical one.)

    >>> round(decode_step_time(30e9, 819e6, 4, 16, "v5e", "int8") * 1e3, 2)   # the book's pop quiz
    2.57
    """
    _checks.count("decode_step_time: batch", batch)
    _checks.count("decode_step_time: chips", chips)
    hardware = hardware_named(hardware)
    bandwidth = chips * hardware.hbm_bandwidth
    flops = chips * hardware.flops
    computed = 2 * batch * params / flops
    weights_read = params * number_bytes(weights) / bandwidth
    matmuls = max(computed, weights_read)
    caches_read = batch * kv_bytes / bandwidth
    return caches_read + matmuls


def prefill_time(params: float, tokens: int, chips: int, hardware: Hardware | str) -> float:
    """Seconds to read ``tokens`` of prompt: a training forward pass, ``2PT / NC`` (attention's
    own FLOPs left out, as the book does; they matter past a context of about the width).

    >>> round(prefill_time(LLAMA2_13B.params, 8192, 8, "v5e") * 1e3, 1)
    135.3
    """
    return 2 * params * tokens / (chips * hardware_named(hardware).flops)


def tensor_parallel_time(
    decoder: Decoder,
    batch: int,
    chips: int,
    hardware: Hardware | str,
) -> float:
    """Seconds one decode step spends in Megatron's collectives: per layer, an all-reduce of the
    ``batch x width`` bf16 activations after attention's out-projection and one after the MLP's.
    Tiny messages: at small batches the per-hop latency, not the bandwidth, prices them.

    >>> round(tensor_parallel_time(LLAMA2_13B, 1, 8, "v5e") * 1e3, 2)   # 80 all-reduces of 10 kB
    0.64
    """
    activations = batch * decoder.width * number_bytes("bfloat16")
    return 2 * decoder.layers * collective_time("all-reduce", activations, chips, hardware)


# --- 3. what fits, and latency against throughput -----------------------------------------------


def cache_fits(
    params: float, kv_bytes: float, chips: int, hardware: Hardware | str, weights: str = "bfloat16"
) -> int:
    """Sequences whose caches (``kv_bytes`` each) fit in the chips' HBM beside the weights.

    >>> cache_fits(LLAMA2_13B.params, 819200 * 8192, 8, "v5e")   # 128 GB less 26 GB of weights
    15
    """
    free = chips * hardware_named(hardware).hbm_bytes - params * number_bytes(weights)
    return max(0, int(free // kv_bytes))


@dataclasses.dataclass(frozen=True)
class Point:
    """A batch size on the latency-throughput curve: step seconds, tokens/s in all and per chip."""

    batch: int
    step: float
    tokens_per_second: float
    per_chip: float


def latency_throughput(
    params: float,
    kv_bytes: float,
    batches: tuple[int, ...],
    chips: int,
    hardware: Hardware | str,
    weights: str = "bfloat16",
) -> list[Point]:
    """The trade a batch makes: each step is slower, but makes ``batch`` tokens at once.

    >>> points = latency_throughput(30e9, 819e6, (4, 256), 16, "v5e", "int8")
    >>> [round(point.tokens_per_second) for point in points]
    [1558, 12161]
    """
    points = []
    for batch in batches:
        step = decode_step_time(params, kv_bytes, batch, chips, hardware, weights)
        points.append(Point(batch, step, batch / step, batch / step / chips))
    return points


__all__ = [
    "MINISHARD_GPT",
    "LLAMA2_13B",
    "LLAMA3_8B",
    "LLAMA3_70B",
    "LLAMA3_405B",
    "SIZES",
    "PALM_540B",
    "MEGATRON_1T",
    "MIXTRAL_8X7B",
    "FORMATS",
    "Decoder",
    "Point",
    "cache_fits",
    "decode_critical_batch",
    "decode_step_time",
    "latency_throughput",
    "number_bytes",
    "prefill_time",
    "tensor_parallel_time",
]
