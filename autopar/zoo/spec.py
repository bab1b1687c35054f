"""Resolve a MODEL argument: a zoo name, ``path/to/file.py:factory`` or ``package.module:factory``.

User factories are called with no arguments under ``torch.device("meta")``,
so a model of any size costs no memory to inspect or plan.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar.errors import ModelSpecError
from autopar.zoo import ZOO, build
from autopar.zoo.gpt import GPTConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class ResolvedModel:
    """A model built from a MODEL argument."""

    name: str
    """The argument as given."""
    module: nn.Module
    """The model, on the meta device."""
    default_seq: int
    """Sequence length to use when none is given."""
    gpt: GPTConfig | None
    """Shape of a zoo GPT (enables the GPT closed-form checks)."""


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable named by ``file.py:factory`` or ``package.module:factory``."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        close = difflib.get_close_matches(spec, list(ZOO), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ModelSpecError(
            f"unknown model {spec!r}{hint}; give a built-in name (see `autopar models`), "
            "path/to/file.py:factory or package.module:factory"
        )
    if target.endswith(".py") or os.path.sep in target:
        if not os.path.isfile(target):
            raise ModelSpecError(f"model file {target!r} does not exist")
        mod_name = "_autopar_user_" + os.path.splitext(os.path.basename(target))[0]
        file_spec = importlib.util.spec_from_file_location(mod_name, target)
        assert file_spec is not None and file_spec.loader is not None
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[mod_name] = module
        try:
            file_spec.loader.exec_module(module)
        except Exception as e:  # the user's code: one line, where it failed
            raise ModelSpecError(f"can't load model file {target!r}: {describe(e, target)}") from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ModelSpecError(f"can't import {target!r} for model {spec!r}: {e}") from None
        except Exception as e:
            raise ModelSpecError(f"importing {target!r} for model {spec!r} failed: {describe(e)}") from None
    if not hasattr(module, attr):
        raise ModelSpecError(f"{target!r} has no attribute {attr!r} (model {spec!r})")
    factory = getattr(module, attr)
    if not callable(factory):
        raise ModelSpecError(f"{spec!r} is not callable; it must be a function returning nn.Module")
    return factory


def describe(e: BaseException, path: str | None = None) -> str:
    """An exception from user code in one line: its type and message, and the line of ``path``
    (or the innermost frame) it came from."""
    first = (str(e).strip().splitlines() or [""])[0]
    where = ""
    if isinstance(e, SyntaxError) and e.lineno:
        first, where = e.msg, f" (line {e.lineno})"
    else:
        frames = traceback.extract_tb(e.__traceback__)
        mine = [f for f in frames if path and os.path.abspath(f.filename) == os.path.abspath(path)] or frames[
            -1:
        ]
        if mine:
            where = f" ({os.path.basename(mine[-1].filename)}, line {mine[-1].lineno})"
    return f"{type(e).__name__}: {first}{where}" if first else f"{type(e).__name__}{where}"


def call_factory(factory: Callable[..., Any], spec: str) -> nn.Module:
    """``factory()``, its failures as one-line errors naming it, and its result an nn.Module."""
    try:
        model = factory()
    except TypeError as e:
        if "required" in str(e) and "argument" in str(e):
            raise ModelSpecError(
                f"model factory {spec!r} needs arguments ({e}); give a function that takes none, "
                "e.g. def make(): return MyModel(cfg)"
            ) from None
        raise ModelSpecError(f"model factory {spec!r} raised {describe(e)}") from None
    except Exception as e:
        raise ModelSpecError(f"model factory {spec!r} raised {describe(e)}") from None
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{spec!r} returned {type(model).__name__}, expected an nn.Module")
    return model


def resolve(spec: str, *, dtype: str | None = "bf16") -> ResolvedModel:
    """Build the model named by ``spec`` on the meta device (cast to ``dtype`` if given)."""
    if dtype is not None and dtype not in DTYPES:
        raise ModelSpecError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype] if dtype else None
    if spec in ZOO:
        entry = ZOO[spec]
        module = build(spec, dtype=torch_dtype or torch.bfloat16)
        gpt = entry.config if isinstance(entry.config, GPTConfig) else None
        return ResolvedModel(name=spec, module=module, default_seq=entry.default_seq, gpt=gpt)
    factory = load_factory(spec)
    with torch.device("meta"):
        module = call_factory(factory, spec)
    if torch_dtype is not None:
        module = module.to(torch_dtype)
    config = getattr(module, "config", None)
    seq = getattr(config, "max_position_embeddings", None) or getattr(config, "block_size", None)
    gpt = config if isinstance(config, GPTConfig) else None
    return ResolvedModel(name=spec, module=module, default_seq=int(seq or 1024), gpt=gpt)


def build_model(spec: str, seed: int = 0) -> nn.Module:
    """MODEL ``spec`` with real fp32 weights on the CPU, seeded (the same on every rank)."""
    torch.manual_seed(seed)
    if spec in ZOO:
        return build(spec, device="cpu", dtype=torch.float32)
    return call_factory(load_factory(spec), spec)


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build models whose parameters live on the meta device while buffers stay real.

        with autopar.meta_parameters():
            model = MyModel(cfg)          # no parameter memory; rotary tables etc. computed
        pm = autopar.parallelize(model, plan)   # a pipeline plan: each rank allocates its stages
        pm.load_full_state_dict(weights)        # or DCP: dcp.load(...) + pm.load_state_dict(...)

    Each parameter is moved to meta as it is registered (constructors then initialise meta
    tensors, which costs nothing); buffers, computed in ``__init__`` and often not saved in
    checkpoints (non-persistent rotary tables), keep their values."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
