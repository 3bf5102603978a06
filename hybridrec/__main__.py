from hybridrec.cli import main

main()
