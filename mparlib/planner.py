"""A layout planner: per-rank memory and step time of a layout, from the course's formulas. Explained in 12_planning.

Nothing here runs a model: every number is arithmetic on sizes, each formula taken from the chapter that measured it.

- :class:`ModelShape`: a transformer's sizes; :meth:`ModelShape.parameters` and :meth:`ModelShape.flops_per_sample`,
- :class:`Cluster`: devices per node, memory, FLOP/s and the alpha-beta model of chapter 08 for the two links,
- :class:`Layout`: the degrees of data (with ZeRO stage), tensor (+ sequence), context, expert and pipeline parallelism,
- :func:`activation_bytes_per_layer`: what one transformer block saves for its backward pass, per token,
- :func:`memory_per_rank`, :func:`step_time`: the prediction for one layout; :func:`plan`: every layout of a grid.

Rank order (which groups share a node): tensor parallel ranks are neighbours, then context, expert and data
parallel ranks, pipeline stages outermost. A group whose ranks span more than one node uses the slower link.
"""
import math
from dataclasses import dataclass, replace

from .checks import finite_float, flag, int_in, one_of, positive_int
from .errors import ConfigError
from .lang import tr
from .schedules import BUBBLE_SCHEDULES, bubble_formula
from .sharding import PRECISIONS, bytes_per_parameter, zero_bytes_per_rank

NORMS = ("layernorm", "rmsnorm")
ATTENTION = ("flash", "scores")  # "flash": a fused kernel keeps no s x s scores; "scores": softmax output kept
OPTIMIZERS = ("adam", "sgd")
RECOMPUTE = (False, True, "selective")  # none, the whole block, the attention's scores only
# The tensor-parallel plan of a block (chapter 10): how each linear layer is split. mparlib.layouts builds DTensor's
# ColwiseParallel / RowwiseParallel from it (layouts.block_plan), and collectives() counts their collectives from it.
TP_PLAN = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.out": "rowwise",
           "mlp.fc1": "colwise", "mlp.gate": "colwise", "mlp.fc2": "rowwise"}
_EXPERT_LAYERS = ("mlp.fc1", "mlp.gate", "mlp.fc2")  # in a mixture of experts, each has one matrix per expert


def _refuse(en, ja):
    raise ConfigError(tr(en, ja))


@dataclass(frozen=True)
class ModelShape:
    """A transformer's sizes, enough to count its parameters, FLOPs and activations. Explained in 12_planning.

    ``layers`` blocks of width ``dim`` with ``heads`` attention heads (``kv_heads`` of them for keys and values,
    grouped-query attention; 0 means ``heads``) and an MLP of width ``hidden`` (``gated``: three matrices, SwiGLU,
    else two). ``seq`` tokens per sample. Inputs: a token table of ``vocab`` rows, or patches of ``patch_pixels``
    values (a convolution with bias, as :class:`mparlib.vit.ViT`), with a learned table of positions when
    ``positions``. Output: ``outputs`` scores (0 means ``vocab``), per token, or once per sample when ``pooled``;
    ``tied`` reuses the token table. ``experts`` >= 2 makes every MLP a mixture of experts of width
    ``expert_hidden`` (0 means ``hidden``), ``top_k`` of them per token (0 or 1: dense). ``attention`` says what the
    attention kernel keeps for backward, ``dropout`` whether the block drops out (masks of 1 byte per value).
    """

    layers: int
    dim: int
    heads: int
    hidden: int
    seq: int
    kv_heads: int = 0
    vocab: int = 0
    outputs: int = 0
    pooled: bool = False
    tied: bool = False
    patch_pixels: int = 0
    positions: bool = False
    gated: bool = False
    bias: bool = False
    norm: str = "layernorm"
    experts: int = 0
    top_k: int = 1
    expert_hidden: int = 0
    attention: str = "flash"
    dropout: bool = False
    name: str = "model"

    def __post_init__(self):
        where = "ModelShape"
        for field in ("layers", "dim", "heads", "hidden", "seq", "top_k"):
            positive_int(getattr(self, field), field, 8, where)
        for field in ("kv_heads", "vocab", "outputs", "patch_pixels", "experts", "expert_hidden"):
            positive_int(getattr(self, field), field, 8, where, minimum=0)
        for field in ("pooled", "tied", "positions", "gated", "bias", "dropout"):
            flag(getattr(self, field), field, where)
        one_of(self.norm, "norm", NORMS, where)
        one_of(self.attention, "attention", ATTENTION, where)
        if self.dim % self.heads or self.heads % self.kv:
            _refuse(f"ModelShape: dim={self.dim} must divide by heads={self.heads}, and heads by kv_heads={self.kv}.",
                    f"ModelShape: dim={self.dim} は heads={self.heads} で、heads は kv_heads={self.kv} で割り切れる"
                    "必要があります。")
        if self.moe and self.top_k > self.experts:
            _refuse(f"ModelShape: top_k={self.top_k} is more than experts={self.experts}; pick at most {self.experts}.",
                    f"ModelShape: top_k={self.top_k} が experts={self.experts} より大きくなっています。"
                    f"{self.experts} 以下にしてください。")

    @property
    def kv(self):
        """Heads of keys and values (``kv_heads``, or ``heads`` when 0)."""
        return self.kv_heads or self.heads

    @property
    def moe(self):
        """True when every MLP is a mixture of experts."""
        return self.experts >= 2

    @property
    def kv_dim(self):
        """Width of the keys (and of the values): ``kv x dim / heads``."""
        return self.kv * self.dim // self.heads

    @classmethod
    def from_vit(cls, config):
        """The shape of ``mparlib.vit.ViT(config)``: tokens ``(28 / patch)^2``, biases, LayerNorm, a pooled head."""
        config.check()
        return cls(layers=config.depth, dim=config.dim, heads=config.heads, hidden=config.hidden,
                   seq=(28 // config.patch) ** 2, outputs=config.classes, pooled=True,
                   patch_pixels=config.patch ** 2, positions=True, bias=True, norm="layernorm",
                   name=f"ViT {config.dim}x{config.depth}")

    @classmethod
    def published(cls, name, seq=8192):
        """A published model by name: ``"llama3-8b"``, ``"llama3-70b"``, ``"llama3-405b"``, ``"mixtral-8x7b"``.

        Sizes as the model cards and papers give them (The Llama 3 Herd of Models, 2024; Mixtral of Experts,
        2024): RMSNorm, SwiGLU MLPs, no biases, 8 key/value heads, untied token tables.
        """
        sizes = {  # layers, dim, heads, kv heads, MLP width, vocab, experts, top-k
            "llama3-8b": (32, 4096, 32, 8, 14336, 128256, 0, 1),
            "llama3-70b": (80, 8192, 64, 8, 28672, 128256, 0, 1),
            "llama3-405b": (126, 16384, 128, 8, 53248, 128256, 0, 1),
            "mixtral-8x7b": (32, 4096, 32, 8, 14336, 32000, 8, 2),
        }
        layers, dim, heads, kv, hidden, vocab, experts, k = sizes[one_of(name, "name", tuple(sizes), "published")]
        return cls(layers=layers, dim=dim, heads=heads, hidden=hidden, seq=seq, kv_heads=kv, vocab=vocab,
                   gated=True, norm="rmsnorm", experts=experts, top_k=k, name=name)

    # counting ------------------------------------------------------------------------------------------------------
    def block_tensors(self):
        """Each parameter of one block, ``{name: shape}``, under the names of :class:`mparlib.vit.Block`.

        Two norms ``norm1`` and ``norm2`` (with a bias under LayerNorm); ``attn.q``, ``attn.k``, ``attn.v`` (keys and
        values ``kv_dim`` wide) and ``attn.out``; the MLP's ``mlp.fc1``, ``mlp.gate`` when gated, ``mlp.fc2``. A
        mixture of experts adds ``mlp.router`` (no bias) and gives each MLP matrix a leading ``experts`` dimension.
        Linear layers have a bias when ``bias``.
        """
        d, kv, shapes = self.dim, self.kv_dim, {}
        width = (self.expert_hidden or self.hidden) if self.moe else self.hidden
        lead = (self.experts,) if self.moe else ()

        def norm(name):
            shapes[f"{name}.weight"] = (d,)
            if self.norm == "layernorm":
                shapes[f"{name}.bias"] = (d,)

        def linear(name, out, inp, first=()):
            shapes[f"{name}.weight"] = (*first, out, inp)
            if self.bias:
                shapes[f"{name}.bias"] = (*first, out)

        norm("norm1")
        for name, out in (("attn.q", d), ("attn.k", kv), ("attn.v", kv), ("attn.out", d)):
            linear(name, out, d)
        norm("norm2")
        if self.moe:
            shapes["mlp.router.weight"] = (self.experts, d)
        for name, out, inp in (("mlp.fc1", width, d), ("mlp.gate", width, d), ("mlp.fc2", d, width)):
            if name != "mlp.gate" or self.gated:
                linear(name, out, inp, lead)
        return shapes

    def outer_tensors(self):
        """The parameters outside the blocks: ``{"embedding": {name: shape}, "head": {...}, "norm": {...}}``.

        A token table ``tokens.weight`` (``vocab`` rows), or a patch embedding ``embed`` (a convolution with bias,
        flattened to ``(dim, patch_pixels)``) and learned positions ``pos`` ``(1, seq, dim)``; the final ``norm``;
        the ``head`` (none when ``tied``).
        """
        d, out = self.dim, self.outputs or self.vocab
        embedding = {"tokens.weight": (self.vocab, d)} if self.vocab else {}
        if self.patch_pixels:
            embedding.update({"embed.weight": (d, self.patch_pixels), "embed.bias": (d,)})
        if self.positions:
            embedding["pos"] = (1, self.seq, d)
        head = {} if self.tied else {"head.weight": (out, d), **({"head.bias": (out,)} if self.bias else {})}
        norm = {"norm.weight": (d,), **({"norm.bias": (d,)} if self.norm == "layernorm" else {})}
        return {"embedding": embedding, "head": head, "norm": norm}

    def mlp_parameters(self, width):
        """Weights (and biases) of one MLP (or one expert) of ``width``: ``2 dim width`` or ``3 dim width`` gated."""
        matrices = 3 if self.gated else 2
        return matrices * self.dim * width + (self.bias and (matrices - 1) * width + self.dim)

    def block_parameters(self):
        """Parameters of one block: the sum of :meth:`block_tensors`."""
        return sum(math.prod(shape) for shape in self.block_tensors().values())

    def outer_parameters(self):
        """Parameters outside the blocks: ``{"embedding": ..., "head": ..., "norm": ...}`` (the final norm)."""
        return {part: sum(math.prod(s) for s in shapes.values()) for part, shapes in self.outer_tensors().items()}

    def parameters(self):
        """Every parameter of the model: ``layers x block + embedding + head``."""
        return self.layers * self.block_parameters() + sum(self.outer_parameters().values())

    def flops_per_sample(self):
        """FLOPs of forward and backward for one sample: 3 x the forward's matmuls, at 2 m n k each.

        Per token and block, forward: projections ``2 (2 d^2 + 2 d kv)``, scores ``Q K^T`` and ``A V``
        ``2 x 2 s d``, the MLP ``2 x matrices x d x width`` (``top_k`` experts and the router for a mixture).
        Plus the patch embedding and the head. Norms, softmax and activations are not counted. The backward pass
        does two matmuls for each one of the forward (input and weight gradients): 3 x in all.
        """
        s, d = self.seq, self.dim
        width = (self.expert_hidden or self.hidden) if self.moe else self.hidden
        mlp = 2 * (3 if self.gated else 2) * d * width
        mlp = mlp * self.top_k + 2 * d * self.experts if self.moe else mlp
        block = 2 * (2 * d * d + 2 * d * self.kv_dim) + 4 * s * d + mlp
        outside = 2 * self.patch_pixels * d * s + 2 * d * (self.outputs or self.vocab) * (1 if self.pooled else s)
        return 3 * (self.layers * block * s + outside)


def activation_bytes_per_layer(model, bytes_per_value=4, *, tp=1, sp=False, regather=False, norm_stats=True):
    """Bytes one block saves for its backward pass, per token of the sequence. Explained in 12_planning.

    The list of what :class:`mparlib.vit.Block` keeps (checked with saved-tensor hooks in the tests), ``e`` bytes
    per value, ``d`` = ``dim``, ``f`` = MLP width, ``a`` = heads, ``s`` = ``seq``:

    - each norm's input and output: ``4 d`` (the outputs feed q, k, v and the first MLP matrix),
    - queries, keys, values ``d + 2 kv``, and the attention's output ``d``, which is also the output projection's
      input (PyTorch's kernels write it in the ``(B, T, heads, d / heads)`` layout of their inputs, so the reshape
      that puts the heads side by side again is a view, not a copy),
    - attention: a fused kernel (``model.attention == "flash"``) adds a log-sum-exp per head (``a`` values of at
      least float32); ``"scores"`` (PyTorch's math kernel) keeps the softmax output ``a s`` values instead (plus,
      with dropout, a mask of ``a s`` bytes and the dropped-out copy ``a s`` values),
    - the MLP: its first matrix's output and the activation's output ``2 f`` (gated: ``4 f``); a mixture of experts
      keeps, for each of its ``top_k`` experts, the dispatched input ``d`` and that, and the router's scores,
    - with dropout, two masks of ``d`` bytes; with ``norm_stats``, each norm's mean and 1/std (at least float32).

    Tensor parallelism (``tp``) splits everything between the norms by ``tp``. Sequence parallelism (``sp``) also
    splits the norms' inputs, statistics and the masks (chapter 11); the gathered norm outputs stay whole (the
    course's block keeps them) unless ``regather``: kept split and gathered again in the backward pass
    (Korthikanti et al., 2022). With ``e = 2``, dropout, scores kept, a 4d MLP and no norm statistics this is their
    ``d (34 + 5 a s / d)``; divided by ``tp`` with ``sp`` and ``regather``.
    """
    e, d, a = bytes_per_value, model.dim, model.heads
    width = (model.expert_hidden or model.hidden) if model.moe else model.hidden
    mlp = (4 if model.gated else 2) * width
    if model.moe:
        mlp = model.top_k * (d + mlp) + model.experts
    split = e * (d + 2 * model.kv_dim + d + mlp)  # q, k, v, attention output (= out-projection input), MLP inside
    wide = max(e, 4)  # softmax and norm statistics are kept in float32 at least
    if model.attention == "flash":
        split += wide * a
    else:
        split += a * model.seq * (e + (1 + e if model.dropout else 0))
    inputs = e * 2 * d + (2 * d if model.dropout else 0) + (4 * wide if norm_stats else 0)  # + masks, statistics
    outputs = e * 2 * d  # the norms' outputs: the inputs of q, k, v and of the MLP
    if not sp:
        return split / tp + inputs + outputs
    return split / tp + inputs / tp + outputs / (tp if regather else 1)


@dataclass(frozen=True)
class Cluster:
    """Devices, their memory and speed, and two links (inside a node, between nodes). Explained in 12_planning.

    ``memory_bytes`` and ``flops_per_s`` per device (the achieved FLOP/s of training, not the data sheet's peak);
    each link is chapter 08's alpha-beta model: ``alpha`` seconds per collective, ``beta`` seconds per byte one
    rank sends (1 / bandwidth in one direction). ``kind_costs``: ``((kind, alpha, beta), ...)`` for kinds of call
    measured on their own (a send to one neighbour costs less than an all-reduce on the same link); a kind not
    listed is priced by the link.
    """

    devices_per_node: int
    memory_bytes: float
    flops_per_s: float
    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter: float
    name: str = "cluster"
    kind_costs: tuple = ()

    def __post_init__(self):
        positive_int(self.devices_per_node, "devices_per_node", 8, "Cluster")
        for field in ("memory_bytes", "flops_per_s"):
            finite_float(getattr(self, field), field, 8e10, "Cluster")
        for field in ("alpha_intra", "beta_intra", "alpha_inter", "beta_inter"):
            finite_float(getattr(self, field), field, 1e-9, "Cluster", minimum=0)
        for entry in self.kind_costs:
            if not (isinstance(entry, tuple) and len(entry) == 3):
                _refuse(f"Cluster: kind_costs holds (kind, alpha, beta) triples, not {entry!r}.",
                        f"Cluster: kind_costs には (kind, alpha, beta) の組を入れてください（{entry!r} ではなく）。")
            one_of(entry[0], "kind", tuple(_SENT), "Cluster.kind_costs")
            for value, field in zip(entry[1:], ("alpha", "beta")):
                finite_float(value, field, 1e-9, "Cluster.kind_costs", minimum=0)

    @classmethod
    def h100(cls, flops_per_s=400e12, alpha=0.0):
        """Servers of 8 H100 SXM 80 GB, NVLink 4 inside, 400 Gb/s InfiniBand per GPU between servers.

        Data sheet: 989 TFLOP/s dense BF16, NVLink 900 GB/s per GPU (both directions: 450 GB/s each way),
        80 GB of HBM3. ``flops_per_s`` defaults to the 400 TFLOP/s per GPU that Llama 3 405B trained at (The
        Llama 3 Herd of Models, 2024: 38-43% of the peak). The published figures give no latencies: ``alpha``
        is 0 unless you pass one.
        """
        return cls(devices_per_node=8, memory_bytes=80e9, flops_per_s=flops_per_s, alpha_intra=alpha,
                   beta_intra=1 / 450e9, alpha_inter=alpha, beta_inter=1 / 50e9, name="H100 SXM x 8 per node")

    @classmethod
    def from_fit(cls, fit, ranks, flops_per_s, memory_bytes, name="measured"):
        """One node of ``ranks`` processes, from chapter 08's ``fit_alpha_beta`` of all-reduce times.

        That fit's ``beta`` is seconds per byte of the message; a ring all-reduce sends ``2 (k - 1) / k`` of it
        from each rank, so the link's ``beta`` is ``fit["beta"] x k / (2 (k - 1))``.
        """
        k = positive_int(ranks, "ranks", 8, "Cluster.from_fit", minimum=2)
        beta = fit["beta"] * k / (2 * (k - 1))
        return cls(devices_per_node=k, memory_bytes=memory_bytes, flops_per_s=flops_per_s, alpha_intra=fit["alpha"],
                   beta_intra=beta, alpha_inter=fit["alpha"], beta_inter=beta, name=name)


@dataclass(frozen=True)
class Layout:
    """How ``world()`` ranks split training: the degree of each kind of parallelism. Explained in 12_planning.

    ``dp`` data-parallel replicas with ZeRO stage ``zero`` (0 = DDP, 1 and 2 as chapter 09, 3 = FSDP's full
    sharding); ``tp`` tensor parallelism (chapter 10), ``sp`` its sequence-parallel form (chapter 11); ``cp``
    context parallelism (ring attention); ``ep`` expert parallelism (its ranks also hold different samples, so
    for every weight outside the experts they are data-parallel ranks too, as in DeepSpeed-MoE and Megatron);
    ``pp`` pipeline stages under ``schedule`` (``bubble_formula``'s names) with ``micro_batches`` per step and
    ``stages_per_rank``; ``recompute``: ``True`` keeps only each block's input and runs its forward again in the
    backward pass, ``"selective"`` recomputes only the attention's scores (Korthikanti et al., 2022: the ``s x s``
    softmax and dropout tensors are dropped, everything else is kept).
    """

    dp: int = 1
    zero: int = 0
    tp: int = 1
    sp: bool = False
    cp: int = 1
    ep: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    micro_batches: int = 1
    stages_per_rank: int = 1
    recompute: bool | str = False

    def __post_init__(self):
        for field in ("dp", "tp", "cp", "ep", "pp", "micro_batches", "stages_per_rank"):
            positive_int(getattr(self, field), field, 2, "Layout")
        int_in(self.zero, "zero", 0, 3, 1, "Layout")
        flag(self.sp, "sp", "Layout")
        if not (self.recompute is False or self.recompute is True or self.recompute == "selective"):  # not 1, 0
            _refuse(f"Layout: recompute={self.recompute!r}: use one of {', '.join(map(repr, RECOMPUTE))}.",
                    f"Layout: recompute={self.recompute!r} は使えません。{'、'.join(map(repr, RECOMPUTE))} の"
                    "どれかを指定してください。")
        one_of(self.schedule, "schedule", BUBBLE_SCHEDULES, "Layout")
        bubble_formula(self.pp, self.micro_batches, schedule=self.schedule, stages_per_rank=self.stages_per_rank)
        if self.sp and self.tp == 1:
            _refuse("Layout: sp=True splits the sequence across the tensor-parallel ranks, and tp=1 has none; "
                    "set tp >= 2 or sp=False.",
                    "Layout: sp=True はテンソル並列のランクの間で系列を分けますが、tp=1 ではランクがありません。"
                    "tp を 2 以上にするか sp=False にしてください。")
        if self.pp > 1 and self.schedule != "gpipe" and self.micro_batches < self.pp:
            _refuse(f"Layout: schedule={self.schedule!r} needs at least as many micro-batches as stages; "
                    f"micro_batches={self.micro_batches} < pp={self.pp}. Use micro_batches >= {self.pp}.",
                    f"Layout: schedule={self.schedule!r} ではステージの数以上のマイクロバッチが必要ですが、"
                    f"micro_batches={self.micro_batches} < pp={self.pp} です。micro_batches を {self.pp} 以上に"
                    "してください。")

    def label(self):
        """A short name such as ``"dp64 tp8+sp pp16 i1F1B x2 ZeRO-1 rc"`` (degrees of 1 left out)."""
        parts = [f"dp{self.dp}"] if self.dp > 1 else []
        if self.tp > 1:
            parts.append(f"tp{self.tp}" + ("+sp" if self.sp else ""))
        parts += [f"{name}{n}" for name, n in (("cp", self.cp), ("ep", self.ep)) if n > 1]
        if self.pp > 1:
            names = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved1f1b": "i1F1B", "zbv": "ZBV"}
            parts.append(f"pp{self.pp} {names[self.schedule]}"
                         + (f" x{self.stages_per_rank}" if self.schedule == "interleaved1f1b" else ""))
        if self.dp * self.cp * self.ep > 1:
            parts.append(f"ZeRO-{self.zero}" if self.zero else "DDP")
        return " ".join(parts + ({True: ["rc"], "selective": ["rc-attn"]}.get(self.recompute, []))) or "1 rank"

    def world(self):
        """The number of ranks: ``dp x tp x cp x ep x pp``."""
        return self.dp * self.tp * self.cp * self.ep * self.pp

    def data_ranks(self, experts=False):
        """Ranks holding the same weights on different tokens: ``dp x cp x ep`` (``dp x cp`` for experts)."""
        return self.dp * self.cp * (1 if experts else self.ep)

    def stage_layers(self, model):
        """Blocks on the first pipeline rank: ``ceil(layers / (pp v))`` per stage, ``v`` stages."""
        chunks = self.pp * self.stages_per_rank
        return math.ceil(model.layers / chunks) * self.stages_per_rank

    def stages_of(self, rank=0):
        """The model stages (chunks of consecutive blocks, 0 first) pipeline rank ``rank`` holds.

        One per rank (stage ``rank``); interleaved 1F1B deals ``stages_per_rank`` round-robin (``rank``,
        ``rank + pp``, ...); zero bubble places two in a V (``rank`` and ``2 pp - 1 - rank``).
        """
        int_in(rank, "rank", 0, self.pp - 1, 0, "Layout.stages_of")
        if self.schedule == "zbv" and self.pp > 1:
            return [rank, 2 * self.pp - 1 - rank]
        return [rank + j * self.pp for j in range(self.stages_per_rank if self.pp > 1 else 1)]

    def check(self, model, global_batch):
        """Raise a clear error if this layout cannot split ``model`` or a batch of ``global_batch`` samples.

        Returns the micro-batch size: ``global_batch / (dp x ep x micro_batches)`` samples.
        """
        positive_int(global_batch, "global_batch", 64, "Layout.check")
        need = [("heads", model.heads, "tp", self.tp), ("kv_heads", model.kv, "tp", self.tp),
                ("hidden", model.hidden, "tp", self.tp), ("seq", model.seq, "cp", self.cp)]
        if model.moe:
            need.append(("experts", model.experts, "ep", self.ep))
            if model.expert_hidden:
                need.append(("expert_hidden", model.expert_hidden, "tp", self.tp))
        for size, value, degree, n in need:
            if value % n:
                _refuse(f"Layout: {size}={value} does not divide by {degree}={n}; pick a {degree} that divides "
                        f"{value}.",
                        f"Layout: {size}={value} は {degree}={n} で割り切れません。{value} を割り切る {degree} を"
                        "選んでください。")
        if self.ep > 1 and not model.moe:
            _refuse(f"Layout: ep={self.ep} splits experts, and {model.name} has none; use ep=1.",
                    f"Layout: ep={self.ep} はエキスパートを分けますが、{model.name} にはエキスパートがありません。"
                    "ep=1 にしてください。")
        if model.layers < self.pp * self.stages_per_rank:
            _refuse(f"Layout: {model.layers} layers cannot fill pp x stages_per_rank = "
                    f"{self.pp * self.stages_per_rank} stages; use fewer stages.",
                    f"Layout: {model.layers}層では pp x stages_per_rank = {self.pp * self.stages_per_rank} 個の"
                    "ステージを埋められません。ステージを減らしてください。")
        split = self.dp * self.ep * self.micro_batches
        if global_batch % split:
            _refuse(f"Layout: global_batch={global_batch} does not divide into dp x ep x micro_batches = {split} "
                    "micro-batches of equal size; change the batch or micro_batches.",
                    f"Layout: global_batch={global_batch} を dp x ep x micro_batches = {split} 個の同じ大きさの"
                    "マイクロバッチに分けられません。バッチか micro_batches を変えてください。")
        return global_batch // split


def in_flight(layout):
    """Micro-batches the first pipeline rank holds activations of, at its peak, in stages. Explained in 12_planning.

    Counted in units of its whole stage; chapter 10's schedules: GPipe runs every forward first (``m``); 1F1B starts a
    backward as soon as it can (``min(m, p)``); zero bubble with the V placement holds as much as 1F1B (Qi et al.,
    2024); interleaved 1F1B holds ``min(m v, p v + p - 1)`` chunks of ``1 / v`` of the stage (Narayanan et al.,
    2021: ``1 + (p - 1) / (p v)`` times 1F1B's ``p``).
    """
    p, m, v = layout.pp, layout.micro_batches, layout.stages_per_rank
    if p == 1:  # no pipeline: micro-batches accumulate gradients one after another
        return 1
    if layout.schedule == "gpipe":
        return m
    if layout.schedule == "interleaved1f1b":
        return min(m * v, p * v + p - 1) / v
    return min(m, p)


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds while training, by part, and their ``total`` at the peak. Explained in 12_planning.

    ``gathered``: ZeRO-3's units held whole; ``flat_copy``: the flat copy of the gradients that the data-parallel
    step makes after the backward pass (``zero`` 0 and 1), when the activations are already freed.
    """

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    gathered: float = 0.0
    flat_copy: float = 0.0

    @property
    def total(self):
        """The peak: the training state, plus the backward pass's activations and gathered units or, after it, the
        flat copy of the gradients, whichever is larger."""
        during = self.activations + self.gathered
        return self.parameters + self.gradients + self.optimizer + max(during, self.flat_copy)


def tp_layers(model):
    """The layers of ``model``'s block that tensor parallelism splits, ``{layer: "colwise" | "rowwise"}``. Explained in 12_planning.

    :data:`TP_PLAN` restricted to the layers the block has (``mlp.gate`` only when gated). Column-wise layers split
    their outputs (rows of the weight, and the bias), row-wise layers their inputs (the bias stays whole).
    """
    names = {name.rpartition(".")[0] for name in model.block_tensors()}
    return {layer: style for layer, style in TP_PLAN.items() if layer in names}


def _local_shape(model, layout, name, shape):
    """This rank's piece of the block tensor ``name``: split as :data:`TP_PLAN` says, experts by ``ep``."""
    layer, _, kind = name.rpartition(".")
    shape = list(shape)
    first = 1 if model.moe and layer in _EXPERT_LAYERS else 0
    if first:
        shape[0] //= layout.ep
    style = TP_PLAN.get(layer) if layout.tp > 1 else None
    if style == "colwise":
        shape[first] //= layout.tp
    elif style == "rowwise" and kind == "weight":
        shape[first + 1] //= layout.tp
    return tuple(shape)


def rank_tensors(model, layout, rank=0):
    """The parameters pipeline rank ``rank`` holds, unit by unit as FSDP wraps them. Explained in 12_planning.

    A list of ``(kind, role, {name: shape})``: for each block of its stages (:meth:`Layout.stages_of`, each stage
    ``stage_layers / stages_per_rank`` blocks) a ``"block"`` unit of kind ``"dense"`` (and, for a mixture of experts,
    one of kind ``"experts"``), then the ``"root"``: the embedding on the first stage (a token table split by ``tp``),
    the final norm and the head on the last (a vocabulary head split by ``tp``). Shapes are this rank's pieces:
    :data:`TP_PLAN`'s splits, experts divided by ``ep``.
    """
    block = {"dense": {}, "experts": {}}
    for name, shape in model.block_tensors().items():
        kind = "experts" if model.moe and name.rpartition(".")[0] in _EXPERT_LAYERS else "dense"
        block[kind][name] = _local_shape(model, layout, name, shape)
    units = [(kind, "block", block[kind]) for _ in range(layout.stage_layers(model))
             for kind in ("dense", "experts") if block[kind]]
    outer, t, root = model.outer_tensors(), layout.tp, {}
    stages = layout.stages_of(rank)
    if 0 in stages:
        root.update({name: (shape[0] // t, *shape[1:]) if name == "tokens.weight" else shape
                     for name, shape in outer["embedding"].items()})
    if layout.pp * layout.stages_per_rank - 1 in stages:
        vocab_head = model.vocab and not model.pooled  # split by tp like the token table
        root.update({name: (shape[0] // t, *shape[1:]) if vocab_head else shape
                     for name, shape in outer["head"].items()})
        root.update(outer["norm"])
    return units + ([("dense", "root", root)] if root else [])


def _count(shapes):
    return sum(math.prod(shape) for shape in shapes.values())


def local_parameters(model, layout):
    """Parameters on the first pipeline rank: ``{"dense": ..., "experts": ...}``. Explained in 12_planning.

    The sum of :func:`rank_tensors`: its blocks' attention and MLP matrices split by ``tp`` (the biases of
    row-split matrices and the norms are whole on every rank, as in chapter 10), experts by ``ep x tp``, the input
    table (a token table split by ``tp``) and, when it also holds the last stage, the final norm and the head.
    """
    return _totals(rank_tensors(model, layout))


def _totals(units):
    """``{"dense": ..., "experts": ...}``: the parameters of :func:`rank_tensors`' units, by kind."""
    out = {"dense": 0, "experts": 0}
    for kind, _, shapes in units:
        out[kind] += _count(shapes)
    return out


def memory_per_rank(model, layout, global_batch, precision="fp32", optimizer="adam", regather=False):
    """Bytes the first pipeline rank holds while training: a :class:`Memory`. Explained in 12_planning.

    Parameters, gradients and optimizer state: chapter 09's ``zero_bytes_per_rank`` (``precision`` one of its
    ``PRECISIONS``) on this rank's share of the weights (:func:`local_parameters`), sharded over the ranks that hold
    the same weights (``layout.data_ranks()``). Activations: :func:`activation_bytes_per_layer` for each token of a
    micro-batch on this rank (``seq / cp`` of each sample), for each block of its stage, for the micro-batches in
    flight (:func:`in_flight`); with ``recompute="selective"``, without the attention's ``s x s`` tensors (what a
    fused kernel keeps: one log-sum-exp per head and token); with ``recompute=True``, only each block's input, plus
    one block in full (``regather``: as :func:`activation_bytes_per_layer`). When it also holds the last stage it
    adds the output scores of one micro-batch with their float32 copy for the loss (``tokens x outputs / tp x
    (e + 4)``).

    Under ZeRO-3 (FSDP) without a pipeline, ``gathered`` adds what chapter 09 measured FSDP2 to hold whole at a
    time: two blocks' parameters (the one computing and the one prefetched) and one block's gradients before their
    reduce-scatter. Inside ``torch.distributed.pipelining`` FSDP2 keeps every unit of the stage whole from its
    first backward pass to the end of the step and accumulates whole gradients, reduce-scattered once after the
    last backward (:func:`collectives`): ``gathered`` is then the stage's whole parameters, and ``gradients`` its
    whole gradients, not a shard. The cheap side of both options (one reduce-scatter per step, gradients sharded)
    exists in no schedule. With ``zero`` 0 or 1 the data-parallel step copies all the gradients into one flat
    vector (``layouts.average_gradients``, chapter 09's ``ShardedOptimizer``): ``flat_copy``, held after the
    backward pass, so the peak is the larger of it and the activations (:attr:`Memory.total`). Buffers of other
    collectives, temporaries and the allocator's fragmentation are not counted.
    """
    one_of(optimizer, "optimizer", OPTIMIZERS, "memory_per_rank")
    micro = layout.check(model, global_batch)
    units = rank_tensors(model, layout)
    local = _totals(units)
    parts = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for kind, n in local.items():
        if n:
            held = zero_bytes_per_rank(n, layout.data_ranks(kind == "experts"), layout.zero, precision, optimizer)
            parts = {k: parts[k] + held[k] for k in parts}
    e = bytes_per_parameter(precision, optimizer)["params"]  # activations in the compute precision
    per_token = activation_bytes_per_layer(model, e, tp=layout.tp, sp=layout.sp, regather=regather)
    if layout.recompute == "selective":  # the scores are not kept: what a fused kernel keeps instead
        per_token = activation_bytes_per_layer(replace(model, attention="flash"), e, tp=layout.tp, sp=layout.sp,
                                               regather=regather)
    tokens = micro * model.seq / layout.cp
    layers = layout.stage_layers(model)
    if layout.recompute is True:
        kept = e * model.dim / (layout.tp if layout.sp else 1)
        activations = tokens * (kept * layers * in_flight(layout) + per_token)
    else:
        activations = tokens * per_token * layers * in_flight(layout)
    if layout.pp * layout.stages_per_rank - 1 in layout.stages_of(0) and not model.pooled:  # it is also the last
        # stage: the scores and the loss's float32 copy
        activations += tokens * (model.outputs or model.vocab) / layout.tp * (e + 4)
    gathered, flat_copy = 0.0, 0.0
    per = bytes_per_parameter(precision, optimizer)
    if layout.zero == 3 and layout.data_ranks() > 1 and layout.pp > 1:  # whole from the first backward on
        whole = sum(local.values())
        gathered, parts["grads"] = whole * per["params"], whole * per["grads"]
    elif layout.zero == 3 and layout.data_ranks() > 1:  # chapter 09: FSDP gathers a block whole to compute it, and
        # prefetches the next; the block's gradients are whole until they are reduce-scattered
        blocks = [_count(shapes) for _, role, shapes in units if role == "block"]
        gathered = sum(blocks) / layers * (2 * per["params"] + per["grads"])
    elif layout.zero <= 1 and layout.data_ranks() > 1:
        flat_copy = sum(local.values()) * per["grads"]
    return Memory(parts["params"], parts["grads"], parts["optimizer"], activations, gathered, flat_copy)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one training step, by part, and their ``total``. Explained in 12_planning.

    ``compute``; the communication of tensor (``tp``), context (``cp``), expert (``ep``) and pipeline (``pp``)
    parallelism, all on the critical path; ``bubble``, the pipeline's idle time; ``dp``, the gradient (and, for
    ZeRO-3, parameter) collectives of the data-parallel ranks, of which ``dp_exposed`` is not hidden by compute.
    """

    compute: float
    tp: float
    cp: float
    ep: float
    pp: float
    bubble: float
    dp: float
    dp_exposed: float

    @property
    def total(self):
        """The step: compute, the serial communication, the bubble and the exposed data-parallel part."""
        return self.compute + self.tp + self.cp + self.ep + self.pp + self.bubble + self.dp_exposed


def link(cluster, span):
    """``(alpha, beta)`` of the link a group spanning ``span`` consecutive ranks uses. Explained in 12_planning."""
    if span <= cluster.devices_per_node:
        return cluster.alpha_intra, cluster.beta_intra
    return cluster.alpha_inter, cluster.beta_inter


def collective_seconds(cluster, span, calls, sent_bytes):
    """Seconds of ``calls`` collectives sending ``sent_bytes`` in all from a rank. Explained in 12_planning.

    ``calls x alpha + sent_bytes x beta``; ``sent_bytes`` is the ring traffic of chapter 08: ``2 (n - 1) / n`` of
    the message for an all-reduce, ``(n - 1) / n`` for a reduce-scatter or an all-gather.
    """
    alpha, beta = link(cluster, span)
    return calls * alpha + sent_bytes * beta


# Bytes each rank sends for a collective whose whole tensor is b bytes, in a group of n (ring algorithms, chapter 08);
# a receive costs nothing of its own: it is the other half of a neighbour's send.
_SENT = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
         "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send": lambda n: 1,
         "recv": lambda n: 0}
KINDS = {"all_reduce": ("all-reduce", "オールリデュース"), "all_gather": ("all-gather", "オールギャザー"),
         "reduce_scatter": ("reduce-scatter", "リデュース・スキャッター"),
         "all_to_all": ("all-to-all", "オールツーオール"), "send": ("send", "送信"), "recv": ("receive", "受信")}
# the kinds a Collective can be, with each edition's label


@dataclass(frozen=True)
class Collective:
    """The collectives of one kind that a rank runs in a step for one purpose. Explained in 12_planning.

    ``part``: what they serve (``"tp"``, ``"cp"``, ``"ep"``, ``"pp"``, ``"dp"``); ``kind``: one of :data:`KINDS`;
    ``calls`` per step; ``bytes`` of all calls together, each counted as chapter 09's
    :class:`~mparlib.sharding.CollectiveLog` counts a call: the whole tensor (an all-reduce's buffer, an
    all-gather's gathered output, a reduce-scatter's unreduced input, what a send sends or a receive receives);
    ``ranks`` in the group; ``span``: the consecutive ranks the group covers, which decides its link.
    """

    part: str
    kind: str
    calls: int
    bytes: float
    ranks: int
    span: int

    @property
    def sent_bytes(self):
        """What one rank sends for them in a ring: ``2 (n - 1) / n`` of an all-reduce, ``(n - 1) / n`` of an
        all-gather, reduce-scatter or all-to-all, all of a send, nothing for a receive."""
        return self.bytes * _SENT[self.kind](self.ranks)

    def seconds(self, cluster):
        """Chapter 08's model: ``calls x alpha + sent_bytes x beta``, with this kind's own alpha and beta where the
        cluster lists them (``Cluster.kind_costs``), else the group's link; a receive: 0."""
        calls = 0 if self.kind == "recv" else self.calls
        for kind, alpha, beta in cluster.kind_costs:
            if kind == self.kind:
                return calls * alpha + self.sent_bytes * beta
        return collective_seconds(cluster, self.span, calls, self.sent_bytes)


def _padded(shapes, k):
    """Elements of FSDP's all-gather output for these tensors: each one's dim 0 padded to a multiple of ``k``."""
    return sum(-(-shape[0] // k) * k * math.prod(shape[1:]) for shape in shapes.values())


def collectives(model, layout, global_batch, precision="fp32", rank=0):
    """Every collective pipeline rank ``rank`` runs in one step, as a list of :class:`Collective`. Explained in 12_planning.

    Counted from the plan the layouts run (:mod:`mparlib.layouts`), ``m`` micro-batches of ``global_batch / (dp
    ep m)`` samples, ``L`` blocks on this rank (:meth:`Layout.stage_layers`), a recomputed forward repeating the
    forward's collectives:

    - ``tp``, from :data:`TP_PLAN`: each row-wise layer all-reduces its output in the forward pass, each column-wise
      layer its input's gradient in the backward pass (DTensor converts each layer's input on its own, so q, k and
      v are three all-reduces: chapter 10). With ``sp``: one all-gather forward and one reduce-scatter backward per
      input that column-wise layers share (attention's, the MLP's), one reduce-scatter forward and one all-gather
      backward per row-wise layer (chapter 11). The vocabulary-parallel loss's small all-reduces are not counted.
    - ``cp``, ring attention (chapter 11): K and V travel on ``cp - 1`` times forward and again backward, dK and dV
      ``cp`` times, each tensor its own send and receive; a pooled model's mean over the tokens adds an all-reduce
      forward and one backward per micro-batch on the last stage.
    - ``ep``: two all-to-alls forward and two backward per layer (chapter 11).
    - ``pp``: per micro-batch, each stage sends its activation on and the gradient back, and receives the same.
    - ``dp``, over the ``dp x cp x ep`` ranks that hold the same weights: ``zero=0`` one all-reduce of all the
      gradients as one flat vector per step (:func:`mparlib.layouts.average_gradients`); ``zero=1`` one flat
      reduce-scatter and one all-gather per step (chapter 09's ``ShardedOptimizer``); ``zero=2`` a reduce-scatter
      per micro-batch (its gradients are sharded as soon as they exist); ``zero=3`` FSDP's units
      (:func:`rank_tensors`), all-gathered with each dim 0 padded to a multiple of the group. Without a pipeline a
      block is gathered for its forward and for its backward and reduce-scattered, the root gathered once, in
      every micro-batch (FSDP2's defaults). Inside ``torch.distributed.pipelining`` the units stay whole after a
      backward and reduce-scatter once, after the last: a block is gathered ``m + 1`` times (each forward that
      follows a forward, the first backward; any order of F and B on a stage, as long as it ends in a backward),
      the root once.

    Everything travels in the compute precision (``precision``'s ``params`` bytes).
    """
    one_of(precision, "precision", tuple(PRECISIONS), "collectives")
    micro = layout.check(model, global_batch)
    found = {}

    def add(part, kind, calls, each, ranks, span):
        if calls:
            key = (part, kind, ranks, span)
            before = found.get(key, (0, 0))
            found[key] = (before[0] + calls, before[1] + calls * each)

    e = PRECISIONS[precision]["params"]
    _model_parallel_collectives(add, model, layout, micro, e, rank)
    _data_parallel_collectives(add, model, layout, e, rank)
    return [Collective(part, kind, calls, nbytes, ranks, span)
            for (part, kind, ranks, span), (calls, nbytes) in found.items()]


def _model_parallel_collectives(add, model, layout, micro, e, rank):
    """:func:`collectives`' tp, cp, ep and pp parts, each passed to ``add(part, kind, calls, bytes_each, ranks,
    span)``."""
    t, c, x, p, m = layout.tp, layout.cp, layout.ep, layout.pp, layout.micro_batches
    stages = layout.stages_of(rank)
    forwards = 2 if layout.recompute is True else 1  # a recomputed block runs its collectives again
    tokens = micro * model.seq / c  # tokens of one micro-batch on this rank
    act = tokens * model.dim * e  # bytes of a (tokens, dim) activation
    runs = layout.stage_layers(model) * m
    if t > 1:
        styles = tp_layers(model)
        column = [layer for layer, style in styles.items() if style == "colwise"]
        rows = len(styles) - len(column)
        inputs = len({layer.partition(".")[0] for layer in column})  # layers reading the same input share it
        if layout.sp:
            add("tp", "all_gather", (inputs * forwards + rows) * runs, act, t, t)
            add("tp", "reduce_scatter", (rows * forwards + inputs) * runs, act, t, t)
        else:
            add("tp", "all_reduce", (rows * forwards + len(column)) * runs, act, t, t)
    if c > 1:
        kv = tokens * model.kv_dim / t * e
        passes = forwards * (c - 1) + (c - 1) + c
        for kind in ("send", "recv"):
            add("cp", kind, 2 * passes * runs, kv, c, t * c)
        if model.pooled and p * layout.stages_per_rank - 1 in stages:
            add("cp", "all_reduce", 2 * m, micro * model.dim * e, c, t * c)
    if x > 1:
        rows_sent = tokens / (t if layout.sp else 1) * model.top_k * model.dim * e
        add("ep", "all_to_all", (2 * forwards + 2) * runs, rows_sent, x, t * c * x)
    if p > 1:
        ends = sum(s < p * layout.stages_per_rank - 1 for s in stages) + sum(s > 0 for s in stages)
        for kind in ("send", "recv"):
            add("pp", kind, ends * m, act / (t if layout.sp else 1), p, layout.world())


def _data_parallel_collectives(add, model, layout, e, rank):
    """:func:`collectives`' dp part, passed to ``add`` as in :func:`_model_parallel_collectives`."""
    m, span = layout.micro_batches, layout.tp * layout.cp * layout.ep * layout.dp
    units = rank_tensors(model, layout, rank)
    for kind in ("dense", "experts"):
        k = layout.data_ranks(kind == "experts")
        mine = [(role, shapes) for unit_kind, role, shapes in units if unit_kind == kind]
        if k == 1 or not mine:
            continue
        n = sum(_count(shapes) for _, shapes in mine)
        if layout.zero == 0:
            add("dp", "all_reduce", 1, n * e, k, span)
        elif layout.zero in (1, 2):
            flat = -(-n // k) * k  # the flat vector padded to equal shards
            add("dp", "reduce_scatter", m if layout.zero == 2 else 1, flat * e, k, span)
            add("dp", "all_gather", 1, flat * e, k, span)
        else:
            for role, shapes in mine:
                whole = _padded(shapes, k) * e
                if layout.pp > 1:
                    add("dp", "all_gather", m + 1 if role == "block" else 1, whole, k, span)
                    add("dp", "reduce_scatter", 1, whole, k, span)
                else:
                    add("dp", "all_gather", 2 * m if role == "block" else m, whole, k, span)
                    add("dp", "reduce_scatter", m, whole, k, span)


def by_kind(found):
    """``{kind: {"calls": n, "bytes": total}}`` of a list of :class:`Collective`. Explained in 12_planning.

    The form of :meth:`mparlib.sharding.CollectiveLog.summary`, so a prediction and a run compare key by key.
    """
    out = {}
    for col in found:
        entry = out.setdefault(col.kind, {"calls": 0, "bytes": 0})
        entry["calls"] += col.calls
        entry["bytes"] += col.bytes
    return out


def step_time(model, layout, global_batch, cluster, precision="fp32", overlap=0.0):
    """Predicted seconds of one step of ``layout``: a :class:`StepTime`. Explained in 12_planning.

    Compute: ``flops_per_sample x global_batch`` shared by all ranks at ``cluster.flops_per_s`` (4/3 of it with
    ``recompute=True``; ``"selective"`` adds the forward of ``Q K^T`` and ``A V`` again, ``4 s^2 d`` per sample and
    block, when the model keeps scores, and nothing with a fused kernel, whose backward recomputes them anyway). Communication: each of :func:`collectives` priced by chapter 08's alpha-beta model
    (:meth:`Collective.seconds`) on the link its group needs (:func:`link`), for the pipeline rank whose
    collectives take longest (the first, a middle or the last stage). The bubble: chapter 10's ``bubble_formula``
    share ``b`` of a step whose busy part is compute plus tp, cp, ep and pp communication, so ``busy x b /
    (1 - b)``. ``overlap``: the share of the data-parallel collectives hidden under compute (0: none hidden, the
    default; at most the compute time is hidden). ``precision``: one of chapter 09's ``PRECISIONS``. A model, not a
    measurement: it leaves out what each collective costs beyond alpha and beta (FSDP's copies in and out of its
    flat buffers, DTensor's bookkeeping) and any overlap of communication with compute other than ``overlap``.
    """
    one_of(precision, "precision", tuple(PRECISIONS), "step_time")
    overlap = finite_float(overlap, "overlap", 0.5, "step_time", minimum=0)
    if overlap > 1:
        _refuse(f"step_time: overlap={overlap} is a share of the data-parallel time; use 0 to 1.",
                f"step_time: overlap={overlap} はデータ並列の時間のうち隠れる割合です。0 から 1 にしてください。")
    layout.check(model, global_batch)
    flops = model.flops_per_sample() * global_batch * (4 / 3 if layout.recompute is True else 1)
    if layout.recompute == "selective" and model.attention == "scores":  # Q K^T and A V once more, forward
        flops += model.layers * 4 * model.seq * model.dim * model.seq * global_batch
    compute = flops / (layout.world() * cluster.flops_per_s)
    share = bubble_formula(layout.pp, layout.micro_batches, schedule=layout.schedule,
                           stages_per_rank=layout.stages_per_rank)
    slowest = None
    for rank in sorted({0, min(1, layout.pp - 1), layout.pp - 1}):
        parts = dict.fromkeys(("tp", "cp", "ep", "pp", "dp"), 0.0)
        for col in collectives(model, layout, global_batch, precision, rank):
            parts[col.part] += col.seconds(cluster)
        if slowest is None or sum(parts.values()) > sum(slowest.values()):
            slowest = parts
    busy = compute + slowest["tp"] + slowest["cp"] + slowest["ep"] + slowest["pp"]
    dp = slowest["dp"]
    exposed = dp - min(overlap * dp, compute)
    return StepTime(compute, slowest["tp"], slowest["cp"], slowest["ep"], slowest["pp"], busy * share / (1 - share),
                    dp, exposed)


@dataclass(frozen=True)
class Plan:
    """One layout with its predicted memory and step time, and whether it ``fits``. Explained in 12_planning."""

    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool


def layouts(model, world, global_batch, *, tp=(1, 2, 4, 8), sp=(True,), cp=(1,), ep=(1,), pp=(1, 2, 4, 8, 16),
            zero=(1,), schedules=("1f1b",), micro_batch_sizes=(1,), recompute=(False, True), stages_per_rank=2):
    """Every valid :class:`Layout` of ``world`` ranks over the grids given. Explained in 12_planning.

    ``dp`` is what the other degrees leave of ``world``; ``micro_batches`` follows from each micro-batch size;
    ``sp`` only applies with ``tp > 1``; ``"interleaved1f1b"`` uses ``stages_per_rank`` and ``"zbv"`` two. Layouts
    the model or the batch cannot take (:meth:`Layout.check`) are left out.
    """
    positive_int(world, "world", 8, "layouts")
    found = []
    for t in tp:
        for c in cp:
            for x in ep:
                for p in pp:
                    if world % (t * c * x * p):
                        continue
                    dp = world // (t * c * x * p)
                    found += _variants(model, global_batch, dict(dp=dp, tp=t, cp=c, ep=x, pp=p), sp, zero,
                                       schedules, micro_batch_sizes, recompute, stages_per_rank)
    return found


def _variants(model, global_batch, degrees, sp, zero, schedules, sizes, recompute, v):
    found = []
    for s in (sp if degrees["tp"] > 1 else (False,)):
        for z in (zero if degrees["dp"] * degrees["cp"] * degrees["ep"] > 1 else (0,)):
            for name in (schedules if degrees["pp"] > 1 else ("1f1b",)):
                for size in sizes:
                    for r in recompute:
                        replicas = degrees["dp"] * degrees["ep"] * size
                        if global_batch % replicas:
                            continue
                        stages = {"interleaved1f1b": v, "zbv": 2}.get(name, 1)
                        try:
                            layout = Layout(**degrees, sp=s, zero=z, schedule=name, stages_per_rank=stages,
                                            micro_batches=global_batch // replicas, recompute=r)
                            layout.check(model, global_batch)
                        except ConfigError:
                            continue
                        found.append(layout)
    return list(dict.fromkeys(found))


def plan(model, cluster, world, global_batch, *, precision="fp32", optimizer="adam", overlap=0.0, regather=False,
         **grid):
    """Every valid layout of ``world`` ranks, predicted and ranked. Explained in 12_planning.

    Returns a list of :class:`Plan`: those that fit ``cluster.memory_bytes`` first, each group by predicted step
    time (ties in the order :func:`layouts` found them). ``grid`` is passed to :func:`layouts`.
    """
    rows = []
    for layout in layouts(model, world, global_batch, **grid):
        memory = memory_per_rank(model, layout, global_batch, precision, optimizer, regather)
        time = step_time(model, layout, global_batch, cluster, precision, overlap)
        rows.append(Plan(layout, memory, time, memory.total <= cluster.memory_bytes))
    return sorted(rows, key=lambda r: (not r.fits, r.time.total))
