"""Any regime by its name: `regime=bs3a5` and `regime=w2b8a1` compose to their micro-batch b, accumulation steps k and
replicas w, as MLflow names the runs, beside conf/regime/'s files (which name the study's regimes). A name of
another form finds no config and gets the group's one-line error (gaexp/config/schema.py `unknown_choice`).

A config source of its own scheme (`gaexp-regime://`), put on the search path of gaexp's own app only: another
Hydra app in the same environment sees no regime group from here. Imports no torch.
"""
from typing import List, Optional

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

GROUP = "regime"


class RegimeConfigSource(ConfigSource):
    """regime/<name>: {batch_size, num_accum, replicas} of the name (gaexp.config.parse_regime)."""

    @staticmethod
    def scheme() -> str:
        return "gaexp-regime"

    @staticmethod
    def _parse(config_path: str) -> Optional[tuple]:
        from gaexp.config import parse_regime

        group, _, name = config_path.removesuffix(".yaml").partition("/")
        return parse_regime(name) if group == GROUP else None

    def load_config(self, config_path: str) -> ConfigResult:
        parsed = self._parse(config_path)
        if parsed is None:
            raise ConfigLoadError(f"{config_path}: not a regime name (bsBaK or wWbBaK)")
        b, k, w = parsed
        return ConfigResult(config=OmegaConf.create({"batch_size": b, "num_accum": k, "replicas": w}),
                            path=f"{self.scheme()}://{self.path}", provider=self.provider, header={"package": None})

    def available(self) -> bool:
        return True

    def is_group(self, config_path: str) -> bool:
        return config_path.strip("/") == GROUP

    def is_config(self, config_path: str) -> bool:
        return self._parse(config_path.rstrip("/")) is not None

    def list(self, config_path: str, results_filter: Optional[ObjectType]) -> List[str]:
        return []  # the names are endless: the group's listing is conf/regime/'s files


class RegimeSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from pathlib import Path

        from gaexp.config import CONFIG_DIR

        ours = any(e.path is not None and Path(e.path.removeprefix("file://")).resolve() == Path(CONFIG_DIR).resolve()
                   for e in search_path.get_path())
        if ours:
            search_path.append(provider="gaexp-regimes", path=f"{RegimeConfigSource.scheme()}://regimes")
