"""The `--help` formatter every `consort` subcommand uses."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each flag's default, where there is one to show: a required flag has none, and an
    unset one (None, or an empty list) says in its help what unset means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default is None or action.default == []:
            return action.help
        return super()._get_help_string(action)
