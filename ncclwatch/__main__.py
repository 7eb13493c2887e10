from ncclwatch.launcher.cli import main

raise SystemExit(main())
