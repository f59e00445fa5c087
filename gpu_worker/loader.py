"""Load a local Hugging Face checkpoint into the project's model code; never touches the network.

Weights come from safetensors (one file, or shards listed in `model.safetensors.index.json`) or,
failing that, PyTorch `.bin` files read with `torch.load(weights_only=True)`. The model is built on
the meta device and each parameter is materialised from its checkpoint tensor, so nothing is
initialised twice and a tensor the checkpoint lacks is an error, not silent random weights.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn
from tqdm import tqdm

from gpu_worker.models import CausalLM, UnsupportedModelError, model_class
from shared.model_dir import ModelDirError, read_json

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """The checkpoint cannot be loaded (missing files, missing or mis-shaped tensors)."""


def load_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise UnsupportedModelError(f"cannot read the model config in {model_dir}: {e}") from None


def resolve_dtype(name: str, device: torch.device, config: Any) -> torch.dtype:
    """"auto": float32 on CPU; on GPU the checkpoint's 16-bit dtype, else bfloat16 (float16 if unsupported)."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = DTYPES.get(stored, stored) if isinstance(stored, str) else stored
    if stored in (torch.bfloat16, torch.float16):
        return stored
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files, safetensors first; sharded checkpoints through their index."""
    for index_name, single_name in (("model.safetensors.index.json", "model.safetensors"),
                                    ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = model_dir / index_name
        if index.is_file():
            try:
                weight_map = read_json(index)["weight_map"]
            except (ModelDirError, KeyError) as e:
                raise ModelLoadError(f"bad checkpoint index {index}: {e}") from None
            files = [model_dir / f for f in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ModelLoadError(f"{index} lists weight files that are missing: {', '.join(missing)}")
            return files
        if (model_dir / single_name).is_file():
            return [model_dir / single_name]
    found = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if found:
        return found
    raise ModelLoadError(f"no weights in {model_dir}: expected model.safetensors, sharded safetensors with "
                         "model.safetensors.index.json, or pytorch_model.bin")


def iter_checkpoint(files: list[Path], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, with a progress bar over tensors."""
    from safetensors import safe_open

    safetensors = [f for f in files if f.suffix == ".safetensors"]
    total = 0
    for f in safetensors:
        with safe_open(str(f), framework="pt") as handle:
            total += len(list(handle.keys()))
    with tqdm(total=total or None, desc="loading weights", unit="tensor", disable=not progress) as bar:
        for f in files:
            if f.suffix == ".safetensors":
                with safe_open(str(f), framework="pt") as handle:
                    for name in handle.keys():
                        yield name, handle.get_tensor(name)
                        bar.update()
            else:
                state = torch.load(f, map_location="cpu", weights_only=True)
                bar.total = (bar.total or 0) + len(state)
                for name, tensor in state.items():
                    yield name, tensor
                    bar.update()


def load_model(model_dir: Path, config: Any, max_model_len: int, device: torch.device, dtype: torch.dtype,
               progress: bool = True) -> CausalLM:
    cls = model_class(config)
    cls.check_config(config, max_model_len)
    with torch.device("meta"):
        model = cls(config)
    load_weights(model, iter_checkpoint(checkpoint_files(model_dir), progress), device, dtype)
    model.to(device)  # non-persistent buffers (rotary frequencies) were built on the CPU
    model.eval()
    log.info("loaded %s from %s: %.1fM parameters, %s on %s", cls.__name__, model_dir,
             sum(p.numel() for p in model.parameters()) / 1e6, str(dtype).removeprefix("torch."), device)
    return model


def load_weights(model: CausalLM, weights: Iterator[tuple[str, torch.Tensor]], device: torch.device,
                 dtype: torch.dtype) -> None:
    params = dict(model.named_parameters())
    shards_left: dict[str, set[int]] = {}
    unexpected: list[str] = []
    for name, tensor in weights:
        mapped = model.map_weight(name, tensor)
        if mapped is None:
            continue
        target, shard, tensor = mapped
        if target not in params:
            unexpected.append(name)
            continue
        module = model.get_submodule(target.rsplit(".", 1)[0])
        param = params[target]
        if param.is_meta:
            param = params[target] = _materialise(module, target, param, device, dtype)
            shards_left[target] = set(range(len(module.out_sizes))) if shard is not None else set()
        view = param.data[module.shard_rows(shard)] if shard is not None else param.data
        if tuple(view.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)} but the model expects "
                                 f"{tuple(view.shape)}: config.json does not match the weights")
        view.copy_(tensor)
        shards_left[target].discard(shard)
    if unexpected:
        log.warning("ignored %d checkpoint tensors this model has no place for: %s", len(unexpected),
                    ", ".join(unexpected[:8]))
    model.tie_weights()
    missing = sorted({n for n, p in model.named_parameters() if p.is_meta} |
                     {n for n, left in shards_left.items() if left})
    if missing:
        raise ModelLoadError(f"the checkpoint lacks {len(missing)} weights: {', '.join(missing[:8])}")


def _materialise(module: nn.Module, name: str, meta: nn.Parameter, device: torch.device,
                 dtype: torch.dtype) -> nn.Parameter:
    param = nn.Parameter(torch.empty(meta.shape, device=device, dtype=dtype), requires_grad=False)
    setattr(module, name.rsplit(".", 1)[1], param)
    return param
