"""The MIG GPU instance profiles of the GPUs envctl can carve, as `nvidia-smi mig -lgip` names
them, with their placements (`-lgipp`): pure data, shared by the spec (allowed names) and the
planner (where each fits).

From NVIDIA's MIG user guide, "Supported MIG Profiles"
(https://docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html): an A100,
H100 or H200 has 7 compute slices and 8 memory slices; a placement is (first memory slice,
memory slices). NVML answers profile queries only once MIG mode is on, so the planner needs
this table to place instances on a GPU whose MIG mode `up` has yet to enable; `up` then looks
each profile up by name through NVML (resources.mig) and refuses one the driver lacks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MigProfile:
    name: str  # 3g.71gb
    size: int  # memory slices of each placement
    starts: tuple[int, ...]  # the first memory slice of each placement, as -lgipp lists them
    most: int  # instances of this profile a GPU can hold at once


# Geometry by profile kind (the same on A100, H100 and H200); "1gX2" is the 1g profile with
# twice the memory (1g.20gb / 1g.35gb), "1g+me" the one with the media engines.
_GEOMETRY = {"1g": (1, tuple(range(7)), 7), "1g+me": (1, tuple(range(7)), 1),
             "1gX2": (2, (0, 2, 4, 6), 4), "2g": (2, (0, 2, 4), 3), "3g": (4, (0, 4), 2),
             "4g": (4, (0,), 1), "7g": (8, (0,), 1)}
# An 80 GB A100 and H100 name their profiles alike.
_NAMES_80GB = {"1g": "1g.10gb", "1g+me": "1g.10gb+me", "1gX2": "1g.20gb", "2g": "2g.20gb",
               "3g": "3g.40gb", "4g": "4g.40gb", "7g": "7g.80gb"}
# The memory in each profile's name, by model (the test on the GPU's name, in order).
_MODELS: tuple[tuple[str, tuple[str, ...], dict[str, str]], ...] = (
    ("H200", ("H200",), {"1g": "1g.18gb", "1g+me": "1g.18gb+me", "1gX2": "1g.35gb",
                         "2g": "2g.35gb", "3g": "3g.71gb", "4g": "4g.71gb", "7g": "7g.141gb"}),
    ("H100 NVL", ("H100", "NVL"), {"1g": "1g.12gb", "1g+me": "1g.12gb+me", "1gX2": "1g.24gb",
                                   "2g": "2g.24gb", "3g": "3g.47gb", "4g": "4g.47gb",
                                   "7g": "7g.94gb"}),
    ("H100 80GB", ("H100",), _NAMES_80GB),
    ("A100 80GB", ("A100", "80GB"), _NAMES_80GB),
    ("A100 40GB", ("A100",), {"1g": "1g.5gb", "1g+me": "1g.5gb+me", "1gX2": "1g.10gb",
                              "2g": "2g.10gb", "3g": "3g.20gb", "4g": "4g.20gb",
                              "7g": "7g.40gb"}),
)
KNOWN_MODELS = tuple(m for m, _, _ in _MODELS)
PROFILE_NAMES = tuple(sorted({n for _, _, names in _MODELS for n in names.values()},
                             key=lambda n: (int(n.split("g", 1)[0]), n)))


def model_profiles(gpu_name: str) -> tuple[str, dict[str, MigProfile]] | None:
    """The model and its profiles by name for a GPU NVML names `gpu_name` ("NVIDIA H200"),
    None for a GPU this table does not know."""
    for model, words, names in _MODELS:
        if all(w in gpu_name for w in words):
            return model, {name: MigProfile(name, *_GEOMETRY[kind])
                           for kind, name in names.items()}
    return None
