"""``python -m profagent``: the CLI. Importing this module runs nothing."""

from profagent.cli import main

if __name__ == "__main__":
    main()
