from proxy.ops.cli import main

raise SystemExit(main())
