"""``python -m kimi_k3.convert synth OUT ...`` writes a synthetic checkpoint;
``python -m kimi_k3.convert --hf-path IN --out OUT ...`` converts a published one."""

import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "synth":
        from kimi_k3.convert import synth

        return synth.main(argv[1:])
    from kimi_k3.convert import convert

    return convert.main(argv)


if __name__ == "__main__":
    sys.exit(main())
