"""``python -m kimi_k3.convert synth OUT ...`` writes a synthetic checkpoint;
``python -m kimi_k3.convert --hf-path IN --out OUT ...`` converts a published one."""

import sys

from kimi_k3.convert import convert, synth


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "synth":
        return synth.main(argv[1:])

    return convert.main(argv)


if __name__ == "__main__":
    sys.exit(main())
