from ncclwatch.watchdog.cli import main

raise SystemExit(main())
