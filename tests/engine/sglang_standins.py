"""Import-time stand-ins for the modules SGLang's attention code imports that cannot run on CPU: the
tests load SGLang's modules with the loader the race suite uses (``readfence.races``)."""

from readfence.races.internal import MODULES, STANDINS, import_sglang, real_triton

__all__ = ["MODULES", "STANDINS", "import_sglang", "real_triton"]
