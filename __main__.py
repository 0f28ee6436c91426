"""``python -m sparkhvd run --np 2 train.py``: the ``sparkhvd`` console script (runner/_cli.py)."""

if __name__ == "__main__":
    import sys

    from sparkhvd.runner._cli import main

    sys.exit(main())
