"""Quantized versions of the bundled model, made by the formats' own tools, cached once per machine.

- AWQ: AutoAWQ's round-to-nearest quantizer (`AwqQuantizer.pseudo_quantize_tensor`) and its GEMM
  packer (`WQLinear_GEMM.from_linear`); group size 64, since the model's 576 input features are not a
  multiple of 128 and AutoAWQ refuses partial groups.
- GPTQ: Intel Neural Compressor, which writes the original GPTQ checkpoint format (AutoGPTQ's layout,
  zero points stored minus one): its GPTQ with act-order (desc_act, asymmetric), and its round-to-nearest
  without act-order (symmetric); group size 128, so 576-feature rows end in a partial group.
- GGUF: the bundled Q4_1 file's weights requantized with the `gguf` package's own quantizer (Q4_0,
  Q8_0) and written with its writer; a small random Llama with K-quant blocks (which `gguf` cannot
  quantize) written block by block.

All start from the bundled GGUF file as transformers loads it. Each lands in
``~/.cache/llmserve/test-checkpoints/<name>-<tool version>-<FIXTURE_VERSION>`` (built in a scratch
folder and renamed into place, so an interrupted build is never reused). The reference perplexities
(`reference_logprobs`) come from transformers on the weights each tool's own dequantizer gives. Each entry is
built under a file lock of its own (`building`): a process that needs an entry another one is building (the
suite's background warm-up, `tests.warm_caches`) waits for it instead of building it again.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inference_engine.model_loader import default_model_path, load_model
from llmserve_kernels.quantized import Int8Weight

FIXTURE_VERSION = 1
CACHE = Path(os.environ.get("LLMSERVE_CACHE", Path.home() / ".cache" / "llmserve")) / "test-checkpoints"
AWQ_GROUP = 64
GPTQ_GROUP = 128
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Calibration text for GPTQ's Hessians (a few sentences suffice for a test checkpoint).
CALIBRATION = [
    "The library opens at nine in the morning and closes at six in the evening on weekdays. ",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Rivers carry water from the mountains to the sea, shaping valleys over thousands of years. ",
    "Bread is made from flour, water, salt and yeast, then baked in a hot oven until golden. ",
]


def _version(dist: str) -> str:
    return importlib.metadata.version(dist)


@contextmanager
def building(name: str) -> Iterator[None]:
    """Held while the cache entry `name` is checked and built: one process builds it, the others wait."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def cached_json(path: Path, compute: Callable[[], Any]) -> Any:
    """The JSON at `path`, written there from `compute()` first (whole or absent) if it is not there yet."""
    if not path.exists():
        with building(path.name):
            if not path.exists():  # nor built while we waited
                path.parent.mkdir(parents=True, exist_ok=True)
                scratch = path.with_suffix(f".{os.getpid()}.tmp")
                scratch.write_text(json.dumps(compute()))
                scratch.replace(path)
    return json.loads(path.read_text())


def _cached(name: str, build: Callable[[Path], None]) -> Path:
    """CACHE/name, built by `build(folder)` into a scratch folder first if it is not there yet."""
    target = CACHE / name
    if target.is_dir():
        return target
    with building(name):
        if target.is_dir():  # built while we waited
            return target
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=CACHE))
        threads = torch.get_num_threads()
        # One thread: GPTQ's many small matmuls ran 20x slower on two threads beside other busy processes.
        torch.set_num_threads(1)
        try:
            build(scratch)
            scratch.rename(target)
        finally:
            torch.set_num_threads(threads)
            shutil.rmtree(scratch, ignore_errors=True)
    return target


# --- the dense model --------------------------------------------------------------------------------


def dense_folder() -> Path:
    """The bundled model as transformers dequantizes the GGUF file: fp32 safetensors, config, tokenizer."""
    key = f"dense-transformers{_version('transformers')}-gguf{_version('gguf')}-{FIXTURE_VERSION}"
    return _cached(key, _build_dense)


def dense_model():
    """transformers' model on `dense_folder()`, fp32, for inference: the bundled model's reference."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(dense_folder()), dtype=torch.float32).eval()


def _build_dense(folder: Path) -> None:
    import transformers

    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dense = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(model.state_dict(), strict=False)
    dense.tie_weights()
    dense.save_pretrained(folder)
    tokenizer = load_model(None, "none").tokenizer
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "eos_token": "<|im_end|>",
        "bos_token": "<|im_start|>",
        "chat_template": tokenizer.chat_template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def _dense_tensors() -> dict[str, torch.Tensor]:
    with safe_open(str(dense_folder() / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS


def _write_folder(folder: Path, tensors: dict[str, torch.Tensor], quantization_config: dict) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    config = json.loads((dense_folder() / "config.json").read_text())
    config["dtype"] = "float16"
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(dense_folder() / name, folder / name)


# --- AWQ ----------------------------------------------------------------------------------------------


def awq_folder() -> Path:
    return _cached(f"awq-g{AWQ_GROUP}-autoawq{_version('autoawq')}-{FIXTURE_VERSION}", _build_awq)


def awq_pack(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AutoAWQ's round-to-nearest quantization and GEMM packing of one fp16 weight [out, in]."""
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer

    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.float16)
    # The quantizer's settings are all pseudo_quantize_tensor reads (its constructor runs calibration).
    settings = SimpleNamespace(w_bit=4, group_size=group_size, zero_point=True)
    linear.weight.data, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(settings, weight.half())
    packed = WQLinear_GEMM.from_linear(
        linear, 4, group_size, False, scales.t().contiguous(), zeros.t().contiguous()
    )
    return {"qweight": packed.qweight, "qzeros": packed.qzeros, "scales": packed.scales}


def awq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """AutoAWQ's own dequantizer, on fp32 scales (its fp16 arithmetic would round): [out, in] fp32."""
    from awq.utils.packing_utils import dequantize_gemm

    return dequantize_gemm(qweight, qzeros, scales.float(), 4, group_size).t().contiguous()


def _build_awq(folder: Path) -> None:
    tensors = {}
    for name, tensor in _dense_tensors().items():
        if _is_projection(name):
            prefix = name.removesuffix(".weight")
            tensors.update({f"{prefix}.{k}": v for k, v in awq_pack(tensor, AWQ_GROUP).items()})
        else:
            tensors[name] = tensor.half()
    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": AWQ_GROUP,
        "zero_point": True,
        "version": "gemm",
    }
    _write_folder(folder, tensors, config)


# --- GPTQ (Intel Neural Compressor) -------------------------------------------------------------------


def gptq_folder(desc_act: bool) -> Path:
    name = f"gptq-g{GPTQ_GROUP}-{'actorder' if desc_act else 'rtn'}-inc{_version('neural-compressor-pt')}"
    return _cached(f"{name}-{FIXTURE_VERSION}", lambda folder: _build_gptq(folder, desc_act))


def _build_gptq(folder: Path, desc_act: bool) -> None:
    import transformers
    from neural_compressor.torch.quantization import GPTQConfig, RTNConfig, convert, prepare, save

    dense = dense_folder()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32).eval()
    if desc_act:
        config = GPTQConfig(
            bits=4, group_size=GPTQ_GROUP, use_sym=False, act_order=True, use_layer_wise=False
        )
        model = prepare(model, config)
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(dense / "tokenizer.json"))
        with torch.no_grad():
            for text in CALIBRATION:
                model(**tokenizer(text * 4, return_tensors="pt"))
        model = convert(model)
    else:
        model = convert(
            prepare(model, RTNConfig(bits=4, group_size=GPTQ_GROUP, use_sym=True, use_layer_wise=False))
        )
    save(model, str(folder), format="huggingface")
    for name in TOKENIZER_FILES:
        shutil.copy(dense / name, folder / name)


def inc_pack(
    weight: torch.Tensor, group_size: int, g_idx: torch.Tensor | None = None, sym: bool = False
) -> dict[str, torch.Tensor]:
    """INC's packing of one weight [out, in] quantized round-to-nearest by its own quantizer, optionally
    with act-order groups (`g_idx`: the group of each input feature, as GPTQ gives it)."""
    from neural_compressor.torch.algorithms.weight_only.modules import INCWeightOnlyLinear
    from neural_compressor.torch.algorithms.weight_only.utility import quant_tensor

    out_features, in_features = weight.shape
    order = torch.arange(in_features) if g_idx is None else torch.sort(g_idx, stable=True).indices
    # As INC's GPTQ does with act-order: quantize the columns sorted by group, pack them back in order.
    scheme = "sym" if sym else "asym"
    int_weight, scale, zp = quant_tensor(
        weight[:, order].clone(), bits=4, group_size=group_size, scheme=scheme, return_int=True
    )
    layer = INCWeightOnlyLinear(
        in_features, out_features, bits=4, group_size=group_size, zp=not sym, g_idx=g_idx is not None
    )
    g = None if g_idx is None else order.to(torch.int32)
    layer.pack(int_weight[:, torch.argsort(order)], scale, zp, None, g_idx=g)
    tensors = {"qweight": layer.qweight, "qzeros": layer.qzeros, "scales": layer.scales}
    if g_idx is not None:
        tensors["g_idx"] = layer.g_idx
    return tensors


def inc_dequantize(
    tensors: dict[str, torch.Tensor], out_features: int, in_features: int, group_size: int
) -> torch.Tensor:
    """INC's own dequantizer (`INCWeightOnlyLinear.recover`) of one packed GPTQ layer: [out, in] fp32."""
    from neural_compressor.torch.algorithms.weight_only.modules import INCWeightOnlyLinear

    layer = INCWeightOnlyLinear(
        in_features, out_features, bits=4, group_size=group_size, zp=True, g_idx="g_idx" in tensors
    )
    for name, tensor in tensors.items():
        getattr(layer, name).copy_(tensor)
    layer.scales = layer.scales.float()  # so its arithmetic is exact, as ours is, not rounded to fp16
    layer.float_type = torch.float32
    return layer.recover().float()


# --- GGUF -------------------------------------------------------------------------------------------


def gguf_file(qtype: str) -> Path:
    """The bundled model with every linear weight requantized to `qtype` (Q4_0 or Q8_0) by `gguf`."""
    name = f"gguf-{qtype.lower()}-gguf{_version('gguf')}-{FIXTURE_VERSION}"
    folder = _cached(name, lambda f: _build_gguf(f, gguf.GGMLQuantizationType[qtype]))
    return folder / f"SmolLM2-135M-Instruct.{qtype}.gguf"


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, skip: Callable[[str], bool]) -> None:
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or skip(name):
            continue
        main = field.types[0]
        sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), main, sub)


def _write_gguf(
    path: Path,
    reader: gguf.GGUFReader,
    tensors: list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]],
    overrides: dict | None = None,
) -> None:
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(path), arch)
    overrides = overrides or {}
    _copy_metadata(reader, writer, skip=lambda name: name in overrides)
    for name, (value, vtype) in overrides.items():
        writer.add_key_value(name, value, vtype)
    for name, data, qtype in tensors:
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _build_gguf(folder: Path, qtype: gguf.GGMLQuantizationType) -> None:
    reader = gguf.GGUFReader(str(default_model_path()))
    tensors = []
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.F32 or t.name == "token_embd.weight":
            tensors.append((t.name, np.array(t.data), t.tensor_type))
        else:
            dense = gguf.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
            tensors.append((t.name, gguf.quantize(dense, qtype), qtype))
    _write_gguf(folder / f"SmolLM2-135M-Instruct.{qtype.name}.gguf", reader, tensors)


def kquant_file(path: Path) -> Path:
    """A two-layer Llama (hidden 256) with the bundled tokenizer and random weights in Q4_K, Q6_K, Q4_0,
    Q4_1, Q8_0, Q5_0 (kept dense by the engine) and F16: valid blocks, with small fp16 scales so the
    model's activations stay finite. `gguf` has no K-quant quantizer, so those blocks are random bytes."""
    rng = np.random.default_rng(0)
    reader = gguf.GGUFReader(str(default_model_path()))
    hidden, ffn, heads, kv_heads, layers = 256, 512, 4, 2, 2
    Q = gguf.GGMLQuantizationType
    U32 = gguf.GGUFValueType.UINT32
    overrides = {
        "llama.embedding_length": (hidden, U32),
        "llama.feed_forward_length": (ffn, U32),
        "llama.block_count": (layers, U32),
        "llama.attention.head_count": (heads, U32),
        "llama.attention.head_count_kv": (kv_heads, U32),
        "llama.rope.dimension_count": (hidden // heads, U32),
    }
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)

    def random_blocks(rows: int, cols: int, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        scales = rng.uniform(2e-3, 2e-2, size=(rows, cols // block, 2)).astype(np.float16).view(np.uint8)
        fields = {Q.Q4_K: (0, 4), Q.Q6_K: (208, 210)}[qtype]  # fp16 d (and dmin) of each block
        data[..., fields[0] : fields[1]] = scales.reshape(rows, cols // block, -1)[
            ..., : fields[1] - fields[0]
        ]
        return data.reshape(rows, -1)

    def quantized(rows: int, cols: int, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
        if qtype in (Q.Q4_K, Q.Q6_K):
            return random_blocks(rows, cols, qtype)
        values = rng.normal(0, 0.05, size=(rows, cols)).astype(np.float32)
        return values.astype(np.float16) if qtype == Q.F16 else gguf.quantize(values, qtype)

    shapes = {
        "attn_q": ((hidden, hidden), Q.Q4_K),
        "attn_k": ((kv_heads * 64, hidden), Q.Q4_K),
        "attn_v": ((kv_heads * 64, hidden), Q.Q6_K),
        "attn_output": ((hidden, hidden), Q.Q5_0),
        "ffn_gate": ((ffn, hidden), Q.Q4_0),
        "ffn_up": ((ffn, hidden), Q.Q4_1),
        "ffn_down": ((hidden, ffn), Q.Q6_K),
    }
    tensors = [("token_embd.weight", quantized(vocab, hidden, Q.Q8_0), Q.Q8_0)]
    tensors.append(("output_norm.weight", np.ones(hidden, dtype=np.float32), Q.F32))
    for i in range(layers):
        for name in ("attn_norm", "ffn_norm"):
            tensors.append((f"blk.{i}.{name}.weight", np.ones(hidden, dtype=np.float32), Q.F32))
        for name, ((rows, cols), qtype) in shapes.items():
            qtype = Q.F16 if (i, name) == (1, "attn_output") else qtype
            tensors.append((f"blk.{i}.{name}.weight", quantized(rows, cols, qtype), qtype))
    _write_gguf(path, reader, tensors, overrides)
    return path


# --- reference perplexities ---------------------------------------------------------------------------


def reference_logprobs(checkpoint: Path, kind: str, token_ids: list[int]) -> list[float]:
    """log p(token i | tokens before it), i >= 1, from transformers in fp32 on the weights the format's own
    dequantizer gives (`kind`: "gguf", "awq", "gptq", or "int8" for the dense folder quantized by
    `Int8Weight.quantize`); cached beside the checkpoint."""
    digest = hashlib.sha1(json.dumps([kind, token_ids]).encode()).hexdigest()[:16]
    folder = checkpoint.parent if checkpoint.is_file() else checkpoint

    def compute() -> list[float]:
        model = _reference_model(checkpoint, kind)
        with torch.inference_mode():
            logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(token_ids[1:])[:, None])
        return logprobs[:, 0].tolist()

    return cached_json(folder / f"reference-{checkpoint.name}-{kind}-{digest}.json", compute)


def _reference_model(checkpoint: Path, kind: str):
    import transformers

    if kind == "gguf" and checkpoint == default_model_path():  # dequantized by transformers already
        return dense_model()
    if kind == "gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(checkpoint.parent), gguf_file=checkpoint.name, dtype=torch.float32
        )
        return model.eval()
    config = transformers.AutoConfig.from_pretrained(str(dense_folder()))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {}
    if kind == "int8":
        for name, tensor in _dense_tensors().items():
            state[name] = Int8Weight.quantize(tensor).dequantize() if _is_projection(name) else tensor
    else:
        quant = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
        with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict
        for name in [n for n in tensors if n.endswith(".qweight")]:
            prefix = name.removesuffix(".qweight")
            parts = {
                p: tensors.pop(f"{prefix}.{p}")
                for p in ("qweight", "qzeros", "scales", "g_idx")
                if f"{prefix}.{p}" in tensors
            }
            if kind == "awq":
                state[f"{prefix}.weight"] = awq_dequantize(
                    parts["qweight"], parts["qzeros"], parts["scales"], quant["group_size"]
                )
            else:
                out_features = parts["scales"].shape[1]
                in_features = parts["qweight"].shape[0] * 8
                state[f"{prefix}.weight"] = inc_dequantize(
                    parts, out_features, in_features, quant["group_size"]
                )
        state.update(
            {n: t.float() for n, t in tensors.items() if n.endswith(("norm.weight", "embed_tokens.weight"))}
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model
