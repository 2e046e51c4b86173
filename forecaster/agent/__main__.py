"""``python -m forecaster.agent [--host H] [--port P]``: the node agent process.

``prewarm agent`` execs this module so that the long-running agent does not
carry the CLI's imports (pandas, SQLAlchemy, Alembic: ~80 MB of resident
memory the agent never uses).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from forecaster.agent.app import create_app
    from forecaster.agent.service import NodeAgent
    from forecaster.settings import SettingsError, load_settings

    parser = argparse.ArgumentParser(prog="prewarm agent", description="prewarm node agent")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if settings.agent_token is None or not settings.agent_token.get_secret_value():
        print("error: the agent needs a bearer token: set PREWARM_AGENT_TOKEN", file=sys.stderr)
        return 2
    agent = NodeAgent.from_settings(settings)
    host, port = args.host or settings.agent_host, args.port or settings.agent_port
    print(f"agent for node {agent.node_name} on {host}:{port}, cache {agent.cache.root}", file=sys.stderr)
    try:
        uvicorn.run(create_app(agent, token=settings.agent_token.get_secret_value()), host=host, port=port,
                    log_level="warning")
    finally:
        agent.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
