from profagent.cli import main

main()
