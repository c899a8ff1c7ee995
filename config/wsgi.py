import os

import django

from config.handlers import WSGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

django.setup(set_prefix=False)
application = WSGIHandler()
