"""`python -m serving.gateway`: the gateway alone, settings from SERVING_* variables (the compose
service runs this; `python -m serving` starts Triton and the gateway together)."""

from __future__ import annotations

import contextlib
import logging
import sys

from pydantic import ValidationError

from serving.gateway.server import serve
from serving.gateway.settings import Settings, settings_help


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv:  # every setting is a SERVING_* variable; the only argument is --help
        print(f"usage: python -m serving.gateway\n\n{__doc__}\nsettings (environment variables):\n{settings_help()}")
        return 0 if argv in (["-h"], ["--help"]) else 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings()
        settings.accepted_keys()  # an unreadable key file fails here, not at the first request
    except (ValidationError, ValueError) as error:
        print(f"error: invalid gateway settings: {error}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the Ctrl-C it handled after a clean stop
        serve(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
