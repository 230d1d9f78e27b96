"""The from-scratch LoRA, NF4 and QLoRA against the libraries people fine-tune with: peft on a
transformers model, bitsandbytes' 4-bit quantisation, and transformers' 4-bit loading.

`compare_nf4` quantises one tensor with `align.nf4` and with
`bitsandbytes.functional.quantize_4bit` on CPU and reports whether the packed 4-bit codes are
identical, how many 8-bit codes of the double-quantised constants differ (bitsandbytes' CPU
kernel does not always pick the nearest of the 256 values; ours does), the largest difference
of the dequantised values, and the bits per parameter both store.

`bnb_cpu_dequantize_error` shows a limit of bitsandbytes' CPU dequantisation kernel: it assumes
every 64-value block lies within one row, so a weight whose rows are not a multiple of 64 long
(in_features 352) comes back wrong there, while its pure-PyTorch path and ours agree (the GPU
kernels, and models whose widths are multiples of 64, are not affected). `paged_optimizer`
shows the other thing a CPU cannot do: paged optimizer state lives in CUDA unified memory, and
on a CPU bitsandbytes falls back to ordinary state.

`compare_lora` builds the reference model, exports it to transformers (`bench.hf.to_hf`: the same
weights and logits), applies peft's LoRA to the export and `align.lora.apply_lora` to the
original with the same targets, rank and alpha, gives peft's B random values (B starts at zero,
which would make equal outputs say nothing), copies A and B into ours, and reports: both
parameter counts, the largest difference of the logits, of every adapter's gradients after one
backward pass, and of the logits after peft's `merge_and_unload` and ours.

`compare_qlora` does the same for QLoRA: the export is saved and loaded back with
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=...)`
(every linear layer of the blocks becomes a bitsandbytes `Linear4bit`, on CPU), peft puts its
LoRA on the targeted ones, and `align.lora.qlora` does the same to the original: the 4-bit codes,
the dequantised weights, the logits and the gradients are compared. Both run in training mode, as
QLoRA does: in eval mode, on a CPU with AVX512-BF16, bitsandbytes' Linear4bit repacks its weight
for a bf16 kernel the first time an input that needs no gradient arrives, and computes in bf16
from then on whatever its compute dtype.

bitsandbytes logs a warning when it is imported on a CPU without its optional `kernels` package,
and transformers shows progress bars while it saves and loads: `quiet` keeps both out of a
notebook's output.

Chapter: book/alignment/lora
"""

from __future__ import annotations

import contextlib
import logging
import re
import tempfile
import warnings
from collections.abc import Iterator
from types import ModuleType

import torch
from torch import nn

from ..bench.hf import check_supported, to_hf
from ..configs import ModelConfig
from ..model import Transformer, lm_loss
from . import lora as L
from . import nf4

BNB_LOGGER = "bitsandbytes.backends.cpu.ops"  # warns at import on a CPU without `kernels`
PEFT_ADAPTER = "default"  # peft's adapter name: lora_A["default"]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence what the libraries write to stderr on a normal CPU run: bitsandbytes' import
    warning, transformers' progress bars and info logs, datasets' progress bars (trl's dataset
    preparation; a notebook shows each as a widget), deprecation warnings."""
    import transformers

    try:
        import datasets
    except ImportError:  # trl's dependency: absent where only peft is installed
        datasets = None
    logging.getLogger(BNB_LOGGER).setLevel(logging.ERROR)
    tlog = transformers.utils.logging
    level, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    data_bars = datasets is not None and datasets.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    if data_bars:
        datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            yield
    finally:
        tlog.set_verbosity(level)
        if bars:
            tlog.enable_progress_bar()
        if data_bars:
            datasets.enable_progress_bars()


def require(name: str) -> ModuleType:
    """peft or bitsandbytes, or a one-line reason they cannot be used."""
    try:
        if name == "bitsandbytes":
            logging.getLogger(BNB_LOGGER).setLevel(logging.ERROR)
        return __import__(name)
    except ImportError:
        raise ValueError(f"{name} is not installed; pip install {name}") from None


def hf_module_name(name: str) -> str:
    """A reference-model module name under transformers' Llama naming:
    'blocks.3.attn.q' -> 'model.layers.3.self_attn.q_proj'."""
    m = re.fullmatch(r"blocks\.(\d+)\.(attn|mlp)\.(\w+)", name)
    if not m or m.group(3) not in L.HF_NAMES:
        raise ValueError(f"{name!r} is not a linear layer of a reference Llama block "
                         "(blocks.<i>.attn.q|k|v|o or blocks.<i>.mlp.gate|up|down)")
    i, part, lin = m.groups()
    return f"model.layers.{i}.{'self_attn' if part == 'attn' else 'mlp'}.{L.HF_NAMES[lin]}"


def peft_lora(hf_model: nn.Module, names: list[str], r: int, alpha: float,
              dropout: float = 0.0, rslora: bool = False) -> nn.Module:
    """peft's LoRA on a transformers model, on the layers whose full reference names are
    `names` (translated to transformers' names, matched exactly)."""
    peft = require("peft")
    hf_names = [hf_module_name(n) for n in names]
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, use_rslora=rslora,
                          target_modules=hf_names)
    return peft.get_peft_model(hf_model, cfg)


def peft_layers(peft_model: nn.Module) -> dict[str, nn.Module]:
    """peft's LoRA layers by their transformers module name (model.layers.0.self_attn.q_proj)."""
    out = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and PEFT_ADAPTER in getattr(module, "lora_A", {}):
            out[name.removeprefix("base_model.model.")] = module
    return out


@torch.no_grad()
def randomize_b(peft_model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Give every B of peft's adapters N(0, std) values (A keeps peft's initialisation)."""
    g = torch.Generator().manual_seed(seed)
    for layer in peft_layers(peft_model).values():
        w = layer.lora_B[PEFT_ADAPTER].weight
        w.copy_(torch.randn(w.shape, generator=g) * std)


@torch.no_grad()
def copy_adapters(peft_model: nn.Module, ours: nn.Module) -> None:
    """Copy peft's A and B into the reference model's LoRALinear layers of the same names."""
    theirs = peft_layers(peft_model)
    for name, layer in L.lora_layers(ours).items():
        src = theirs.get(hf_module_name(name))
        if src is None:
            raise ValueError(f"peft has no adapter on {hf_module_name(name)}: the two models "
                             "were given different targets")
        layer.lora_A.copy_(src.lora_A[PEFT_ADAPTER].weight)
        layer.lora_B.copy_(src.lora_B[PEFT_ADAPTER].weight)


def _grads(ours: nn.Module, peft_model: nn.Module) -> float:
    """Largest |difference| between the two models' adapter gradients, over all adapters."""
    theirs = peft_layers(peft_model)
    worst = 0.0
    for name, layer in L.lora_layers(ours).items():
        src = theirs[hf_module_name(name)]
        for mine, other in ((layer.lora_A, src.lora_A[PEFT_ADAPTER].weight),
                            (layer.lora_B, src.lora_B[PEFT_ADAPTER].weight)):
            worst = max(worst, float((mine.grad - other.grad).abs().max()))
    return worst


def _check(cfg: ModelConfig, batch: int, seq_len: int) -> None:
    check_supported(cfg)
    if cfg.flavour != "llama":
        raise ValueError(f"{cfg.name}: the comparison maps Llama module names; GPT-2's fused "
                         "c_attn has no per-projection layers to match")
    for name, v in (("batch", batch), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds {cfg.name}'s max_seq_len {cfg.max_seq_len}")


def _batch(cfg: ModelConfig, batch: int, seq_len: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _forward_backward(ours, theirs, x, y) -> dict:
    """Logits of both, one backward pass through each; the largest differences."""
    mine, loss = ours(x, y)
    other = theirs(input_ids=x).logits
    loss.backward()
    lm_loss(other, y).backward()
    mine, other = mine.detach(), other.detach()
    return {"logits_max_diff": float((mine - other).abs().max()),
            "logits_max_abs": float(other.abs().max()),
            "grad_max_diff": _grads(ours, theirs),
            "grad_max_abs": max(float(p.grad.abs().max()) for p in ours.parameters()
                                if p.requires_grad)}


def compare_nf4(x: torch.Tensor, double: bool = True,
                blocksize: int = nf4.BLOCKSIZE) -> dict:
    """align.nf4 against bitsandbytes.functional.quantize_4bit / dequantize_4bit (nf4) on the
    same tensor, on CPU; see the module docstring."""
    bnb = require("bitsandbytes")
    q = nf4.quantize(x, "nf4", blocksize, double)
    packed, state = bnb.functional.quantize_4bit(x, blocksize=blocksize, quant_type="nf4",
                                                 compress_statistics=double)
    theirs = bnb.functional.dequantize_4bit(packed, state)
    out = {"codes_equal": torch.equal(q.packed, packed),
           "dequant_max_diff": float((nf4.dequantize(q, x.dtype) - theirs).abs().max()),
           "dequant_max_abs": float(theirs.abs().max()),
           "ours_bits_per_param": q.bits_per_param()}
    stored = packed.nbytes + state.absmax.nbytes
    if double:
        stored += state.state2.absmax.nbytes + state.offset.nbytes
        diff = (q.absmax.long() - state.absmax.long()).abs()
        out["constant_codes_differing"] = int((diff > 0).sum())
        out["constant_codes_max_step"] = int(diff.max())
        out["constants"] = q.absmax.numel()
        out["offset_diff"] = abs(q.offset - float(state.offset))
    out["bnb_bits_per_param"] = 8 * stored / x.numel()
    return out


def bnb_cpu_dequantize_error(shape: tuple[int, int], seed: int = 0,
                             blocksize: int = nf4.BLOCKSIZE) -> dict:
    """Largest |W - dequantised W| of an N(0, 0.02) weight of `shape`, by bitsandbytes' CPU
    kernel (what Linear4bit computes with on CPU), by its pure-PyTorch path, and by ours."""
    bnb = require("bitsandbytes")
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    if len(shape) != 2 or not all(isinstance(s, int) and s > 0 for s in shape):
        raise ValueError(f"shape must be (rows, columns) of positive integers, got {shape!r}")
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02
    packed, state = bnb.functional.quantize_4bit(w, blocksize=blocksize, quant_type="nf4")
    kernel = bnb.functional.dequantize_4bit(packed, state)
    code = bnb.functional.get_4bit_type("nf4", device="cpu")
    reference = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)
    torch_path = reference(packed.reshape(-1), state.absmax, code, blocksize, shape,
                           torch.float32)  # __wrapped__: without torch.compile's minute
    ours = nf4.dequantize(nf4.quantize(w, "nf4", blocksize))
    return {"shape": tuple(shape), "row_multiple_of_block": shape[1] % blocksize == 0,
            "bnb_cpu_kernel": float((kernel - w).abs().max()),
            "bnb_torch_path": float((torch_path - w).abs().max()),
            "ours": float((ours - w).abs().max()),
            "ours_vs_torch_path": float((ours - torch_path).abs().max())}


def paged_optimizer(device: str = "cpu") -> dict:
    """What bitsandbytes' PagedAdamW does on `device`: one step on a small parameter, the
    warnings it raised, and whether its state is paged (CUDA unified memory, which the driver
    pages to the host when the GPU runs short: QLoRA's answer to memory spikes)."""
    if not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:i]', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for but no GPU is visible; use device='cpu' to see "
                         "the CPU fallback")
    bnb = require("bitsandbytes")
    p = nn.Parameter(torch.randn(4096, device=device))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = bnb.optim.PagedAdamW([p], lr=1e-3)
        p.grad = torch.randn_like(p)
        opt.step()
    state = opt.state[p]["state1"]
    return {"device": device, "warnings": [str(w.message) for w in caught],
            "state_paged": bool(getattr(state, "is_paged", False)),
            "state_device": str(state.device)}


def compare_lora(cfg: ModelConfig, targets: L.Targets = L.ALL_LINEAR, r: int = 8, alpha: float = 16,
                 batch: int = 2, seq_len: int = 32, seed: int = 0) -> dict:
    """Ours against peft on the same model, adapters and batch (fp32 on CPU); see the module
    docstring for what is compared."""
    L.check_hyper(r, alpha, 0.0)
    _check(cfg, batch, seq_len)
    with torch.random.fork_rng(devices=[]), quiet():
        torch.manual_seed(seed)
        ours = Transformer(cfg)
        pm = peft_lora(to_hf(ours), L.target_names(ours, targets), r, alpha)
        L.apply_lora(ours, targets, r, alpha)
        randomize_b(pm, seed)
        copy_adapters(pm, ours)
        x, y = _batch(cfg, batch, seq_len, seed)
        out = {"peft_counts": tuple(pm.get_nb_trainable_parameters()),
               "ours_counts": L.counts(ours)}
        out.update(_forward_backward(ours, pm, x, y))
        with torch.no_grad():
            merged = pm.merge_and_unload()(input_ids=x).logits
            L.merge_and_unload(ours)
            mine = ours(x)[0]
        out["merged_max_diff"] = float((mine - merged).abs().max())
        out["lora_modules_left"] = sum(isinstance(m, L.LoRALinear) for m in ours.modules())
    return out


def load_4bit(model: Transformer, double: bool = True) -> nn.Module:
    """The reference model exported to transformers and loaded back in 4 bits, NF4, as a user
    loads a checkpoint for QLoRA (CPU, fp32 compute)."""
    import transformers

    require("bitsandbytes")
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                        bnb_4bit_use_double_quant=double,
                                        bnb_4bit_compute_dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp, quiet():
        to_hf(model).save_pretrained(tmp)
        return transformers.AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=q, device_map="cpu", dtype=torch.float32)


def compare_qlora(cfg: ModelConfig, targets: L.Targets = L.ALL_LINEAR, r: int = 8,
                  alpha: float = 16, batch: int = 2, seq_len: int = 32, seed: int = 0,
                  double: bool = True) -> dict:
    """Ours (align.nf4 + align.lora) against transformers' 4-bit loading + peft: same codes,
    dequantised weights, logits and adapter gradients (fp32 compute on CPU)."""
    L.check_hyper(r, alpha, 0.0)
    _check(cfg, batch, seq_len)
    bnb = require("bitsandbytes")
    with torch.random.fork_rng(devices=[]), quiet():
        torch.manual_seed(seed)
        ours = Transformer(cfg)
        h4 = load_4bit(ours, double)
        names = L.target_names(ours, targets)
        pm = peft_lora(h4, names, r, alpha).train()  # see the module docstring
        L.qlora(ours, names, r, alpha, double=double)
        randomize_b(pm, seed)
        copy_adapters(pm, ours)
        codes_equal, weight_diff, kinds = True, 0.0, set()
        theirs = peft_layers(pm)
        for name, layer in L.lora_layers(ours).items():
            base = theirs[hf_module_name(name)].base_layer
            kinds.add(type(base).__name__)
            codes_equal &= torch.equal(layer.base.packed, base.weight.data)
            w = bnb.functional.dequantize_4bit(base.weight.data, base.weight.quant_state)
            weight_diff = max(weight_diff, float((layer.base.weight_dequantized() - w)
                                                 .abs().max()))
        x, y = _batch(cfg, batch, seq_len, seed)
        out = {"peft_counts": tuple(pm.get_nb_trainable_parameters()),
               "ours_counts": L.counts(ours), "base_layers": sorted(kinds),
               "codes_equal": codes_equal, "weight_max_diff": weight_diff}
        out.update(_forward_backward(ours, pm, x, y))
    return out
