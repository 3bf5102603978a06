"""`python -m hybridrec.app.report RUN_DIR [--screenshot PNG]`: re-render a run's report.html (write.main)."""
import sys

from hybridrec.app.report.write import main

sys.exit(main())
