"""Train the depth and size policies with PPO (stable-baselines3) on exact trace replay.

Not implemented yet: this stub exists so the command line is stable. See README's roadmap.
"""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python train.py", description=__doc__).parse_args(argv)
    print("train.py: not yet implemented (PPO depth/size policies land with the training issue)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
