from e31.cli import main

main()
