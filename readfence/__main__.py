"""``python -m readfence``: the ``readfence`` command, where its console script is not on ``PATH``
(a virtual environment not activated, an interpreter chosen by its path)."""

from readfence.cli import main

if __name__ == "__main__":
    main(prog_name="readfence")
