"""Prefect's server on https: its API and UI app under uvicorn with a certificate.

`prefect server start` has no TLS options; it runs this same app (create_app, final) under
uvicorn in the foreground, which is what this does with uvicorn's ssl_certfile/ssl_keyfile.
Its settings come from the environment as for `prefect server start` (PREFECT_HOME, the
database URL, PREFECT_SERVER_API_AUTH_STRING); PREFECT_UI_API_URL tells the UI, served on
https, where the API is. Run as `python -m infra.prefect_https HOST PORT CERT KEY`.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    import uvicorn
    from prefect.server.api.server import create_app
    from prefect.settings import (
        PREFECT_SERVER_API_KEEPALIVE_TIMEOUT,
        PREFECT_SERVER_LOGGING_LEVEL,
    )

    host, port, cert, key = argv
    uvicorn.run(
        app=create_app(final=True),
        host=host,
        port=int(port),
        ssl_certfile=cert,
        ssl_keyfile=key,
        timeout_keep_alive=PREFECT_SERVER_API_KEEPALIVE_TIMEOUT.value(),
        log_level=PREFECT_SERVER_LOGGING_LEVEL.value().lower(),
    )


if __name__ == "__main__":
    main(sys.argv[1:])
