from pd_router.cli import main

main()
