from django.contrib import admin
from django.urls import include, path
from shop.views import place_order, place_order_plainly

from dramatiq_pg_fenced.integrations.django import dashboard_urls

urlpatterns = [
    path("admin/", admin.site.urls),
    path("orders/", place_order),
    path("orders/plainly/", place_order_plainly),
    path("ops/queues/", include(dashboard_urls(actions=True))),
]
