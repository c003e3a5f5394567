"""posattn mechanisms added to a pretrained ``transformers`` encoder, keeping every pretrained weight.

    model = AutoModel.from_pretrained(folder)
    add_mechanisms(model, ["tisa"], mode="supplement")      # s_ij += f_θ(j − i), TISA Eq 4 case a

Every self-attention of the model gets its own mechanisms (``position_mechanisms`` on the
self-attention module, so they train, save and load with it). Where they act:

- BERT / MiniLM, RoBERTa, XLM-R, CamemBERT, ELECTRA: the self-attention already calls a function
  from transformers' attention-function registry, chosen by ``config._attn_implementation``;
  ``add_mechanisms`` registers ``"posattn"`` there (with transformers' boolean padding mask)
  and switches the model to it. The function runs the mechanisms' q/k/v transforms, score terms
  and output transforms around posattn's attention (``path``: ``"fast"`` or ``"reference"``).
  A mixer (a mechanism that replaces softmax(s)·V: Linformer, LinCAT, Landmark CAT) is applied
  there in place of the softmax product, as in posattn's own layer. A mechanism that reads the
  layer's input x (``reads_layer_input``: ConvBERT, conv_qkv) is refused by name: the attention
  function receives q, k and v, never x.
- MPNet: its self-attention takes no attention function but adds a ``position_bias`` to every
  score; a forward pre-hook adds the mechanisms' score terms to it. Only score-level
  mechanisms (no q/k/v or output transform, and no mixer) can be added there.

Modes (TISA Eq 4): ``supplement`` keeps the model's position embeddings; ``replace`` removes
them (TISA App. C): the mean position embedding is folded into the word embeddings, the position
table is zeroed and frozen (and MPNet's relative bias too).

``init``, how the added mechanisms start:

- left out (``None``): in ``supplement`` mode every mechanism with a *neutral start*
  (:meth:`~posattn.mechanisms.base.Mechanism.start_at_zero`: it adds exactly nothing at first
  and still trains; TISA a = 0, T5's and DIET-REL's tables = 0, DIET-ABS P_K = 0, the
  convolutions' weights = 0, CAT's identity filters) takes it and the others (ALiBi, RoPE,
  TUPE, the mixers) keep their own initialisation; in ``replace`` mode every mechanism keeps
  its own initialisation;
- ``"zero"``: every mechanism takes its neutral start, so the model computes exactly what it did
  before; refused, naming them, where a mechanism has none;
- ``"default"``: every mechanism keeps posattn's own initialisation;
- a :class:`~posattn.analysis.tisa_fit.TisaFit` (see :func:`fit_kernels`, which is ``posattn
  analyze fit-tisa``'s regression to the model's own F̂_P) sets the kernels of the mechanisms
  that take fitted kernels (TISA), so ``replace`` starts close to the original function.

``save_pretrained`` stores the mechanisms' weights and ``config.posattn_retrofit``;
:func:`load_retrofitted` reads such a folder back.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file
from torch import Tensor, nn
from transformers import AttentionInterface, AutoModel, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..analysis.hf import PADDING_OFFSET_TYPES, HFCheckpoint, resolve
from ..analysis.profiles import hf_profiles
from ..analysis.tisa_fit import TisaFit, fit_tisa
from ..attention.layer import PATHS, mix
from ..errors import PositionError
from ..mechanisms import REGISTRY, Context, Dims, Mechanism, Spec, SpecLike, build, get
from ..mechanisms.base import check_inputs
from .modeling import shared_parameters

Mode = Literal["supplement", "replace"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
IMPLEMENTATION = "posattn"
INTERFACE_TYPES = {"bert", "roberta", "xlm-roberta", "camembert", "electra"}
HOOK_TYPES = {"mpnet"}


def _context(b: int, n: int, keep: Tensor | None, device: torch.device) -> Context:
    positions = torch.arange(n, device=device).expand(b, n)
    return Context(positions=positions, segments=torch.zeros_like(positions), keep=keep, causal=False)


def _keep(mask: Tensor | None) -> Tensor | None:
    """[b, n] key mask from transformers' boolean [b, 1, q, k] padding mask (None: no padding)."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        raise PositionError(f"posattn attention expects transformers' boolean padding mask, got {mask.dtype}")
    keep = mask[:, 0, 0, :]
    return None if bool(keep.all()) else keep


def posattn_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[Tensor, None]:
    """The ``"posattn"`` entry of transformers' attention-function registry: posattn attention with
    the module's ``position_mechanisms`` (q, k, v: [b, h, n, d_h]; returns [b, n, h, d_h])."""
    mechs: nn.ModuleList = module.position_mechanisms
    b, _, n, d = query.shape
    if scaling is not None and abs(scaling * d ** 0.5 - 1) > 1e-6:
        raise PositionError(f"posattn attention assumes the 1/√d_h score scale; this model uses {scaling}")
    ctx = _context(b, n, _keep(attention_mask), query.device)
    check_inputs(mechs, ctx)
    q, k, v = query, key, value
    for m in mechs:
        q, k, v = m.transform_qkv(q, k, v, ctx)
    o = mix(list(mechs), q, k, v, ctx, module.position_path, dropout, module.training)  # or the mixer
    for m in mechs:
        o = m.transform_output(o, v, ctx)
    return o.transpose(1, 2).contiguous(), None


def _add_position_bias(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """MPNet pre-hook: position_bias (3rd argument) += the mechanisms' score terms."""
    hidden, mask, bias = (list(args) + [None, None])[:3]
    mechs: nn.ModuleList = module.position_mechanisms
    b, n, _ = hidden.shape
    h = module.num_attention_heads
    ctx = _context(b, n, None, hidden.device)
    check_inputs(mechs, ctx)
    q = module.q(hidden).view(b, n, h, -1).transpose(1, 2)
    k = module.k(hidden).view(b, n, h, -1).transpose(1, 2)
    extra = sum(t.dense(n) for m in mechs for t in m.score_terms(q, k, ctx))
    bias = extra if bias is None else bias + extra
    return (hidden, mask, bias, *args[3:]), kwargs


def _register() -> None:
    AttentionInterface.register(IMPLEMENTATION, posattn_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def _self_attentions(model: PreTrainedModel) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("SelfAttention")]


def _is_plain(m: Mechanism) -> bool:
    """Acts only through score terms (no q/k/v or output transform, no mixer)."""
    return not m.mixes and all(getattr(type(m), hook) is getattr(Mechanism, hook)
                               for hook in ("transform_qkv", "transform_output"))


def _specs(mechanisms: list[SpecLike], mode: Mode) -> list[Spec]:
    """Parse, with each mechanism's options for a model that keeps (``supplement``) or loses
    (``replace``) its position embeddings (:meth:`Mechanism.retrofit_options`)."""
    specs = [Spec.parse(s) for s in mechanisms]
    return [Spec(s.name, get(s.name).retrofit_options(s.options, mode == "supplement")) for s in specs]


def _check_structure(layer: list[Mechanism], kind: str) -> None:
    """Refuse, by name, what this model's self-attention cannot run (see the module docstring)."""
    if kind in HOOK_TYPES:
        bad = [m.name for m in layer if not _is_plain(m)]
        if bad:
            raise PositionError(f"add_mechanisms: {', '.join(bad)} transform q/k/v or the output, or replace "
                                f"softmax attention; {kind} takes score-level mechanisms only")
    for m in layer:
        if m.reads_layer_input:
            raise PositionError(f"add_mechanisms: {m.name} reads the layer's input x, which transformers' "
                                f"attention function does not receive; it cannot be added to a pretrained {kind}")


def add_mechanisms(model: PreTrainedModel, mechanisms: list[SpecLike], mode: Mode = "supplement",
                   init: Literal["zero", "default"] | TisaFit | None = None,
                   path: Literal["fast", "reference"] = "fast") -> PreTrainedModel:
    """Add ``mechanisms`` (names or specs such as ``"alibi"``, ``{"name": "t5", "num_buckets": 32}``;
    score-level and q/k/v ones, see the module docstring) to every self-attention of ``model`` in
    place; returns ``model``.

    ``mode``: ``"supplement"`` keeps the model's position embeddings, ``"replace"`` removes them.
    ``init`` (see the module docstring): left out, each mechanism starts neutral where it can (the
    pretrained model's outputs unchanged by it) and at its own initialisation otherwise (always
    its own in ``replace`` mode); ``"zero"`` demands a neutral start of every mechanism;
    ``"default"`` keeps posattn's initialisation; a TISA fit (:func:`fit_kernels`) sets TISA's
    kernels. ``path``: posattn's ``"fast"`` or ``"reference"`` attention."""
    cfg = model.config
    kind = cfg.model_type
    if kind not in INTERFACE_TYPES | HOOK_TYPES:
        raise PositionError(f"add_mechanisms: model type {kind!r} is not supported; supported: "
                            f"{', '.join(sorted(INTERFACE_TYPES | HOOK_TYPES))}")
    if mode not in ("supplement", "replace"):
        raise PositionError(f"add_mechanisms: unknown mode {mode!r}; valid: supplement, replace")
    if path not in PATHS:
        raise PositionError(f"add_mechanisms: unknown path {path!r}; valid: {', '.join(PATHS)}")
    if not (init in (None, "zero", "default") or isinstance(init, TisaFit)):
        raise PositionError(f"add_mechanisms: init must be left out, 'zero', 'default' or a TisaFit, got {init!r}")
    if getattr(cfg, "is_decoder", False):
        raise PositionError("add_mechanisms: the model is configured as a decoder; only encoders are supported")
    attns = _self_attentions(model)
    if any(hasattr(a, "position_mechanisms") for a in attns):
        raise PositionError("add_mechanisms: this model already has posattn mechanisms; add them all in one call")
    offset = cfg.pad_token_id + 1 if kind in PADDING_OFFSET_TYPES else 0
    dims = Dims(cfg.hidden_size, cfg.num_attention_heads, len(attns), cfg.max_position_embeddings - offset,
                max(int(getattr(cfg, "type_vocab_size", 1) or 1), 1), False)
    specs = _specs(mechanisms, mode)
    for s in specs:
        if get(s.name).placement_for(s.options) == "input":
            raise PositionError(f"add_mechanisms: {s.name} acts on the input embeddings; "
                                f"only attention-level mechanisms can be added to a pretrained model")
    # the model's own position embeddings play posattn's "absolute" in supplement mode
    built = build([*specs, "absolute"] if mode == "supplement" else specs, dims)
    _check_structure(built.layers[0], kind)
    _initialise(built.layers, init if init is not None else ("neutral" if mode == "supplement" else "default"))
    first = next(model.parameters())
    for attn, mechs in zip(attns, built.layers):
        attn.position_mechanisms = nn.ModuleList(mechs).to(device=first.device, dtype=first.dtype)
        attn.position_path = path
        if kind in HOOK_TYPES:
            attn.register_forward_pre_hook(_add_position_bias, with_kwargs=True)
    tied = {k: v for k, v in shared_parameters(model).items() if ".position_mechanisms." in k}
    model._tied_weights_keys = {**(model._tied_weights_keys or {}), **tied}  # t5's bias: saved once
    model.all_tied_weights_keys.update(tied)
    if mode == "replace":
        remove_position_embeddings(model, offset)
    if kind in INTERFACE_TYPES:
        _register()
        model.set_attn_implementation(IMPLEMENTATION)
    cfg.posattn_retrofit = {"mechanisms": [s.to_json() for s in specs], "mode": mode, "path": path}
    return model


def _initialise(layers: list[list[Mechanism]], init: str | TisaFit) -> None:
    """``neutral``: the mechanisms with a neutral start take it, the others keep their own
    initialisation; ``zero``: every mechanism takes its neutral start; a fit: its kernels into the
    mechanisms that take fitted kernels; ``default``: as built."""
    if init == "default":
        return
    if isinstance(init, TisaFit):
        if init.a.shape[0] != len(layers):
            raise PositionError(f"add_mechanisms: the fit has shape {init.a.shape} (layers, heads, kernels); "
                                f"the model has {len(layers)} layers")
        if not all(any([m.set_kernels({name: getattr(init, name)[layer] for name in ("a", "b", "c")})
                        for m in mechs]) for layer, mechs in enumerate(layers)):
            takers = [name for name, cls in REGISTRY.items() if cls.set_kernels is not Mechanism.set_kernels]
            raise PositionError(f"add_mechanisms: a fit sets fitted kernels, but {' or '.join(takers)} "
                                f"is not among the mechanisms")
        return
    without = sorted({m.name for mechs in layers for m in mechs if not m.start_at_zero()})
    if without and init == "zero":
        raise PositionError(f"add_mechanisms: init='zero' needs a neutral start, which {', '.join(without)} "
                            f"does not have; leave init out to start it at its own initialisation")


def remove_position_embeddings(model: PreTrainedModel, offset: int) -> None:
    """TISA App. C: fold the mean position embedding into the word embeddings, then zero and
    freeze the position table (and MPNet's relative attention bias)."""
    emb = model.base_model.embeddings
    with torch.no_grad():
        table = emb.position_embeddings.weight
        emb.word_embeddings.weight += table[offset:].mean(0)
        table.zero_()
        table.requires_grad_(False)
        rel = getattr(model.base_model.encoder, "relative_attention_bias", None)
        if rel is not None:
            rel.weight.zero_()
            rel.weight.requires_grad_(False)


def fit_kernels(model: str | Path, n_kernels: int = 5, positions: int = 128,
                method: Literal["embedding", "forward"] = "embedding", **fit_options: Any) -> TisaFit:
    """TISA kernels per layer and head fitted to the checkpoint's own positional scores F̂_P
    (TISA App. C; exactly ``posattn analyze fit-tisa``'s regression). ``model``: a folder, or
    ``minilm`` / ``mpnet``."""
    prof = hf_profiles(HFCheckpoint.open(resolve(model)), n=positions, method=method)
    return fit_tisa(prof.scores, n_kernels, **fit_options)


def retrofit_tisa(folder: str | Path, fit: TisaFit, mode: Mode, out: str | Path) -> PreTrainedModel:
    """TISA §5 / App. C on a checkpoint folder: the pretrained model (every weight kept) with
    ``tisa`` in every self-attention, kernels set from ``fit``, saved to ``out`` with
    ``save_pretrained`` beside the checkpoint's tokenizer files. Load it with
    :func:`load_retrofitted` and any head class (a missing head is initialised as usual)."""
    model = AutoModel.from_pretrained(folder)
    add_mechanisms(model, [{"name": "tisa", "n_kernels": int(fit.a.shape[-1])}], mode, init=fit)
    out = Path(out)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(folder) / name).is_file():
            shutil.copy(Path(folder) / name, out / name)
    return model


def load_retrofitted(folder: str | Path, cls: type = AutoModel, **kwargs: Any) -> PreTrainedModel:
    """Load a model saved (``save_pretrained``) after :func:`add_mechanisms`: ``cls.from_pretrained``,
    the mechanisms rebuilt from ``config.posattn_retrofit``, then their saved weights."""
    model = cls.from_pretrained(folder, **kwargs)
    spec = getattr(model.config, "posattn_retrofit", None)
    if not spec:
        raise PositionError(f"{folder}: config.json has no posattn_retrofit entry; load it with {cls.__name__}")
    add_mechanisms(model, spec["mechanisms"], spec["mode"], init="default", path=spec["path"])
    weights = Path(folder) / "model.safetensors"
    saved = {k: v for k, v in load_file(weights).items() if ".position_mechanisms." in k}
    mine = {k for k in model.state_dict() if ".position_mechanisms." in k} - set(model.all_tied_weights_keys)
    if set(saved) != mine:
        raise PositionError(f"{weights}: mechanism tensors differ from the rebuilt model's "
                            f"(missing {sorted(mine - set(saved))[:3]}, unexpected {sorted(set(saved) - mine)[:3]})")
    model.load_state_dict(saved, strict=False)
    return model
