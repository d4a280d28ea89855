"""``/v1/models``, the check that a request names a model we serve, and the LoRA adapters served by name.

With LoRA on (``--enable-lora``), each adapter is a model of its own name whose ``parent`` is the base model; a
request picks it by ``model``. Adapters come from ``--lora-modules`` at start and from ``POST
/v1/load_lora_adapter`` at run time (``/v1/unload_lora_adapter`` removes one). An unknown name is a 404.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList
from pagedllm.logger import init_logger
from pagedllm.lora.request import AdapterRef, LoRARequest

logger = init_logger(__name__)


class ServingModels:
    def __init__(self, served_names: list[str], model_path: str, max_model_len: int,
                 architecture: str | None = None,
                 resolve_adapter: Callable[[LoRARequest], AdapterRef] | None = None) -> None:
        self.served_names = served_names
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.architecture = architecture
        # Checks an adapter against the base model (the engine front end's ``resolve_lora``); None: LoRA off.
        self.resolve_adapter = resolve_adapter
        self.adapters: dict[str, AdapterRef] = {}
        self._adapter_ids = itertools.count(1)
        self._adapter_lock = asyncio.Lock()

    @property
    def default_name(self) -> str:
        return self.served_names[0]

    def check(self, name: str | None) -> str:
        """The name to echo back; an unknown name is a 404 (an omitted model means the default)."""
        if name is None or name == "":
            return self.default_name
        if name not in self.served_names and name not in self.adapters:
            served = ", ".join([*self.served_names, *self.adapters])
            raise OpenAIError(f"The model `{name}` does not exist. Served models: {served}", status=404,
                              param="model")
        return name

    def adapter(self, name: str | None) -> AdapterRef | None:
        """The LoRA adapter a request's ``model`` names, None for the base model."""
        return self.adapters.get(name) if name else None

    # ---- adapters ------------------------------------------------------------------------------------------
    def add_adapter(self, name: str, path: str) -> AdapterRef:
        """Check and register adapter ``name`` (ValueError saying why not); blocking (reads its files)."""
        if self.resolve_adapter is None:
            raise OpenAIError("LoRA adapters are not enabled on this server; start it with --enable-lora",
                              param="lora_name")
        if not name or not path:
            raise OpenAIError("lora_name and lora_path are both required", param="lora_name" if not name else
                              "lora_path")
        if name in self.adapters or name in self.served_names:
            raise OpenAIError(f"The model `{name}` is already served; unload it first to load other weights",
                              param="lora_name")
        ref = self.resolve_adapter(LoRARequest(name, next(self._adapter_ids), path))
        self.adapters[name] = ref
        logger.info("LoRA adapter %r loaded from %s (content digest %s)", name, ref.path, ref.digest[:12])
        return ref

    async def load_adapter(self, name: str, path: str) -> AdapterRef:
        async with self._adapter_lock:  # one name, one check at a time
            try:
                return await asyncio.to_thread(self.add_adapter, name, path)
            except ValueError as e:
                raise OpenAIError(str(e), param="lora_path") from None

    def unload_adapter(self, name: str) -> None:
        if self.resolve_adapter is None:
            raise OpenAIError("LoRA adapters are not enabled on this server; start it with --enable-lora",
                              param="lora_name")
        if name not in self.adapters:
            raise OpenAIError(f"The LoRA adapter `{name}` is not loaded", status=404, param="lora_name")
        del self.adapters[name]
        logger.info("LoRA adapter %r unloaded", name)

    def list(self) -> ModelList:
        from pagedllm.model_executor.models.registry import architecture_formats, supported_architectures

        cards = [ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len,
                           architecture=self.architecture) for name in self.served_names]
        cards += [ModelCard(id=name, root=ref.path, parent=self.default_name, max_model_len=self.max_model_len,
                            architecture=self.architecture) for name, ref in self.adapters.items()]
        return ModelList(data=cards, supported_architectures=supported_architectures(),
                         architecture_formats=architecture_formats())

