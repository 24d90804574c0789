"""Pod configuration: the manifest (SPEC §3) and how it is loaded."""

from .load import ManifestError, load_manifest, manifest_to_dict, manifest_to_toml
from .manifest import (
    FILE_TOOLS,
    KNOWN_TOOLS,
    BudgetConfig,
    CompactionConfig,
    FieldError,
    Manifest,
    NotifyConfig,
    PodSection,
    ProviderConfig,
    ScopeRule,
    ScopeSection,
    SpawnConfig,
    ToolOutputConfig,
    WorkerConfig,
)

__all__ = [
    "FILE_TOOLS",
    "KNOWN_TOOLS",
    "BudgetConfig",
    "CompactionConfig",
    "FieldError",
    "Manifest",
    "ManifestError",
    "NotifyConfig",
    "PodSection",
    "ProviderConfig",
    "ScopeRule",
    "ScopeSection",
    "SpawnConfig",
    "ToolOutputConfig",
    "WorkerConfig",
    "load_manifest",
    "manifest_to_dict",
    "manifest_to_toml",
]
