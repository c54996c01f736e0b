from sandbox_client.cli import main

raise SystemExit(main())
