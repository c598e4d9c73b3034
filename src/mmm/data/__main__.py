"""``python -m mmm.data prepare ...``: write token files (see :mod:`mmm.data.prepare`)."""

import sys

from mmm.errors import UsageError, print_error

COMMANDS = {"prepare": "text files -> train.bin / val.bin / meta.json for --dataset bin"}


def cli(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        usage = "usage: python -m mmm.data COMMAND ...\n" + "".join(f"  {k:10s}{v}\n" for k, v in COMMANDS.items())
        if argv and argv[0] not in ("-h", "--help"):
            print_error(f"unknown command {argv[0]!r}; choose one of: {', '.join(COMMANDS)}", prog="python -m mmm.data")
            return 2
        sys.stdout.write(usage)
        return 0 if argv else 2
    from mmm.data.prepare import PROG, main

    try:
        return main(argv[1:])
    except UsageError as err:
        print_error(str(err), prog=PROG)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(cli())
