from hybridrec.app.cli import main

main()
