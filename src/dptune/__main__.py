"""``python -m dptune …`` runs the ``dptune`` command line (where the script is not on PATH)."""

from dptune.cli import main

if __name__ == "__main__":
    main()
