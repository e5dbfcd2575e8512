from loopformer.cli import main

main()
