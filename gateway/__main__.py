"""`python -m gateway`: the OpenAI-compatible HTTP gateway (settings from flags or PAGEDSERVE_* variables)."""
from __future__ import annotations

import argparse
import sys

from gateway.app import run
from shared.log import setup_logging
from shared.model_dir import ModelDirError
from shared.settings import Settings, SettingsError
from shared.tenants import TenantError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    Settings.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_args(args)
    except SettingsError as e:
        parser.error(str(e))
    setup_logging("gateway", settings.log_level)
    try:
        return run(settings)
    except (ModelDirError, TenantError) as e:
        print(f"gateway: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
