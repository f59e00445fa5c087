from pagedserve.cli import main

main()
