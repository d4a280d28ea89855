"""``/v1/models`` and the check that a request names a model we serve."""

from __future__ import annotations

from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList


class ServingModels:
    def __init__(self, served_names: list[str], model_path: str, max_model_len: int,
                 architecture: str | None = None) -> None:
        self.served_names = served_names
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.architecture = architecture

    @property
    def default_name(self) -> str:
        return self.served_names[0]

    def check(self, name: str | None) -> str:
        """The name to echo back; unknown names are a 400 (an omitted model means the default)."""
        if name is None or name == "":
            return self.default_name
        if name not in self.served_names:
            served = ", ".join(self.served_names)
            raise OpenAIError(f"The model `{name}` does not exist. Served models: {served}", param="model")
        return name

    def list(self) -> ModelList:
        from pagedllm.model_executor.models.registry import architecture_formats, supported_architectures

        return ModelList(data=[ModelCard(id=name, root=self.model_path, max_model_len=self.max_model_len,
                                         architecture=self.architecture) for name in self.served_names],
                         supported_architectures=supported_architectures(),
                         architecture_formats=architecture_formats())
